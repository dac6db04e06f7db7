#!/usr/bin/env bash
# The web stack `tessera serve` needs beyond what the device machine has, as wheels for it
# (x86-64, CPython 3.12), in .whl/ (git ignores it): what the device check's §10 (serving)
# starts a server with. Run here, in the repository root, before the device call; name .whl
# in its carry; gpu_session.sh installs them where .whl/ holds any (~20 MB):
#
#     benchmarks/gpu_wheels.sh && # device run, carry [".whl"]:
#     benchmarks/gpu_session.sh 0 540 serving
#
# The packages the machine's image already holds (the device tool's KINDS.md) are dropped:
# two versions of one package stop the install there.
set -eu
dest=.whl
mkdir -p "$dest"
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
    -d "$dest" 'litestar>=2.23,<3' 'msgspec>=0.18' 'uvicorn>=0.30' 'httptools>=0.6' \
    'sqlalchemy[asyncio]>=2.0.30,<2.2' 'aiosqlite>=0.20' 'asyncpg>=0.29' 'alembic>=1.13' \
    'swagger-ui-bundle>=1.1' 'llguidance>=1.0,<2'
# already on the machine (KINDS.md, 2026-11-17)
for present in anyio certifi click h11 httpcore httpx idna jinja2 markdown_it_py markupsafe \
    mdurl multidict pygments pyyaml PyYAML rich typing_extensions uvloop; do
    rm -f "$dest/${present}"-[0-9]*.whl
done
ls "$dest"
du -sh "$dest"
