#!/usr/bin/env bash
# Here (with PyPI): download the wheels the GPU machine lacks into .whl/, for its Python 3.12
# on x86-64; the device call then carries .whl (docs/performance.md, "GPU check (#27)").
# The machine's image has torch, nvidia-ml-py, prometheus-client, typing-extensions, mdurl
# (the device tool's KINDS.md); ddpwatch's own needs travel here, at the versions the tests
# here use. Pure-Python ones are carried too where the image's version may be too old
# (textual needs rich>=14.2 and pygments>=2.19.2).
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
rm -rf .whl && mkdir -p .whl
platforms=()
for n in 2_28 2_27 2_26 2_17 2014 1; do
  case $n in
    2014) platforms+=(--platform manylinux2014_x86_64) ;;
    1) platforms+=(--platform manylinux1_x86_64) ;;
    *) platforms+=(--platform "manylinux_${n}_x86_64") ;;
  esac
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl \
  pyzmq==27.3.0 msgspec==0.22.0 prometheus-client==0.26.0 \
  textual==8.2.8 rich==15.0.0 pygments==2.21.0 platformdirs==4.14.8 \
  markdown-it-py==4.3.0 mdit-py-plugins==0.7.0 linkify-it-py==2.2.0
ls .whl
du -sh .whl
