# Sourced by scripts/run and scripts/test: create or reuse .venv and install the
# project (with the extras named in FERRUM_EXTRAS) when pyproject.toml, setup.py or the C
# extension's source changed (an editable install builds the extension in place).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${FERRUM_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
    echo "ferrum: creating virtual environment in $venv" >&2
    "$python" -m venv "$venv"
fi
stamp="$venv/.ferrum-install-${FERRUM_EXTRAS:-base}"
want="$(cat "$root/pyproject.toml" "$root/setup.py" "$root"/ferrum_mac/backends/mlx/cpu/_cpu_blas.c | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "ferrum: installing dependencies (first run takes a few minutes)" >&2
    spec="$root"
    [ -n "${FERRUM_EXTRAS:-}" ] && spec="$root[$FERRUM_EXTRAS]"
    log="$venv/install.log"
    if ! "$venv/bin/python" -m pip install -e "$spec" >"$log" 2>&1; then
        grep -v '^WARNING: Location' "$log" | tail -n 20 >&2
        echo "ferrum: installing dependencies failed (full log: $log)" >&2
        exit 1
    fi
    echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
