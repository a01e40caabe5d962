"""Tokenizers from a sentencepiece `tokenizer.model`, through the sentencepiece library.

Sentencepiece knows nothing of special tokens written as text, so `encode` first cuts the
text at control and user-defined pieces ('<s>', '</s>', ...), as transformers does. A chunk
after such a token gets no dummy-prefix space unless `legacy` is set (transformers'
`legacy=False`, the LlamaTokenizer default).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

from ferrum_mac.errors import CorruptModelError
from ferrum_mac.text.tokenizer import REPLACE_EACH_BYTE, KeepStart, TextStart, Tokenizer

if TYPE_CHECKING:  # sentencepiece and protobuf load on first use (an import most models never need)
    from sentencepiece import sentencepiece_model_pb2

SPACE = "▁"


class SentencePieceStart:
    """Sentencepiece's own rule for the start of a text: until some text has come out, a piece
    loses its leading '▁'; after one such space was consumed, the next pieces keep theirs
    (unless the model removes extra whitespace, where every leading space goes)."""

    def __init__(self, tokenizer: "SentencePieceTokenizer"):
        self._sp = tokenizer.processor
        self._collapse = tokenizer.remove_extra_whitespaces
        self._space_seen = False

    def trim(self, token_id: int, data: bytes) -> tuple[bytes, bool]:
        sp = self._sp
        if sp.is_byte(token_id) or sp.is_unknown(token_id):
            return data, True
        if sp.is_control(token_id):
            self._space_seen = False
            return data, False
        consumed = sp.id_to_piece(token_id).startswith(SPACE)
        if consumed:
            data = data[1:]
        self._space_seen = consumed and not self._collapse
        return data, self._space_seen or bool(data)


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model behind ferrum's interface."""

    def __init__(
        self,
        model_file: str | Path,
        *,
        add_bos: bool = True,
        add_eos: bool = False,
        legacy: bool = False,
        extra_eos_ids: Iterable[int] = (),
    ):
        import sentencepiece as spm

        proto = _read_proto(Path(model_file))
        self.processor = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
        self.add_dummy_prefix = proto.normalizer_spec.add_dummy_prefix
        self.remove_extra_whitespaces = proto.normalizer_spec.remove_extra_whitespaces
        proto.normalizer_spec.add_dummy_prefix = False
        self._no_prefix = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
        self._unk_surface = (proto.trainer_spec.unk_surface or " \u2047 ").encode("utf-8")
        self.add_bos, self.add_eos, self.legacy = add_bos, add_eos, legacy

        sp = self.processor
        self.vocab_size = sp.get_piece_size()
        self.bos_id, self.eos_id = _valid(sp.bos_id()), _valid(sp.eos_id())
        self.bos_token = sp.id_to_piece(self.bos_id) if self.bos_id is not None else None
        self.eos_token = sp.id_to_piece(self.eos_id) if self.eos_id is not None else None
        self.unk_token = sp.id_to_piece(sp.unk_id()) if _valid(sp.unk_id()) is not None else None
        self.pad_token = sp.id_to_piece(sp.pad_id()) if _valid(sp.pad_id()) is not None else None
        self.eos_ids = frozenset(i for i in (self.eos_id, *extra_eos_ids) if i is not None)
        self.special_ids = frozenset(i for i in range(self.vocab_size) if sp.is_control(i))
        self.utf8_errors = REPLACE_EACH_BYTE
        self._specials = _special_pieces_pattern(proto)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.bos_id] if add_special_tokens and self.add_bos and self.bos_id is not None else []
        start = 0
        for m in self._specials.finditer(text) if self._specials else ():
            ids += self._encode_chunk(text[start : m.start()], first=start == 0)
            ids.append(self.processor.piece_to_id(m.group()))
            start = m.end()
        ids += self._encode_chunk(text[start:], first=start == 0)
        if add_special_tokens and self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def _encode_chunk(self, chunk: str, first: bool) -> list[int]:
        if not chunk:
            return []
        # A model that collapses whitespace would drop a chunk's leading space altogether;
        # keep one, as transformers does.
        keeps_one_space = self.remove_extra_whitespaces and chunk[0].isspace()
        processor = self.processor if first or self.legacy or keeps_one_space else self._no_prefix
        return processor.encode(chunk)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [i for i in ids if 0 <= i < self.vocab_size]
        if skip_special_tokens:
            return self.processor.decode(ids)
        parts, run = [], []
        for i in ids:
            if i in self.special_ids:
                parts += [self.processor.decode(run), self.processor.id_to_piece(i)]
                run = []
            else:
                run.append(i)
        return "".join(parts) + self.processor.decode(run)

    def id_to_piece(self, token_id: int) -> str | None:
        return self.processor.id_to_piece(token_id) if 0 <= token_id < self.vocab_size else None

    def piece_to_id(self, piece: str) -> int | None:
        token_id = self.processor.piece_to_id(piece)
        return None if token_id == self.processor.unk_id() and piece != self.unk_token else token_id

    def _token_bytes(self, token_id: int) -> bytes:
        sp = self.processor
        if not 0 <= token_id < self.vocab_size or sp.is_control(token_id):
            return b""
        if sp.is_unknown(token_id):
            return self._unk_surface
        piece = sp.id_to_piece(token_id)
        if sp.is_byte(token_id):
            return bytes([int(piece[3:5], 16)])
        return piece.replace(SPACE, " ").encode("utf-8")

    def text_start(self) -> TextStart:
        if self.add_dummy_prefix or self.remove_extra_whitespaces:
            return SentencePieceStart(self)
        return KeepStart()


def _read_proto(path: Path) -> sentencepiece_model_pb2.ModelProto:
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except Exception:
        raise CorruptModelError(f"{path} is not a sentencepiece model; download the tokenizer again") from None
    if not proto.pieces:
        raise CorruptModelError(f"{path} holds no sentencepiece vocabulary; download the tokenizer again")
    return proto


def _special_pieces_pattern(proto: sentencepiece_model_pb2.ModelProto) -> re.Pattern | None:
    kinds = {proto.SentencePiece.CONTROL, proto.SentencePiece.USER_DEFINED, proto.SentencePiece.UNKNOWN}
    pieces = sorted({p.piece for p in proto.pieces if p.type in kinds and p.piece}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, pieces))) if pieces else None


def _valid(token_id: int) -> int | None:
    return token_id if token_id >= 0 else None
