#!/bin/sh
# Creates (once) the Python virtual environment the model-file test uses: safetensors + numpy.
# Usage: scripts/py-setup.sh DIR   (prints DIR/bin/python on success)
set -eu
dir=${1:?usage: py-setup.sh DIR}
if [ ! -x "$dir/bin/python" ] || ! "$dir/bin/python" -c "import safetensors, numpy" 2>/dev/null; then
    python3 -m venv "$dir" >&2
    "$dir/bin/pip" install --quiet --disable-pip-version-check safetensors numpy >&2
fi
echo "$dir/bin/python"
