#!/usr/bin/env bash
# Build .devsite for scripts/device_check.sh on a lent GPU machine that cannot reach PyPI and
# takes at most 64 MiB with the repo: cp312 wheels of what its image lacks, NIXL for CUDA 13
# cut down to its UCX backend (the wheel is 59 MB) and stripped, and the embedded model's
# tokenizer and config. Run from the repo root with .venv set up; add /.devsite/ to
# .git/info/exclude and carry ".devsite".
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=$(mktemp -d) && trap 'rm -rf "$wheels"' EXIT
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp -d "$wheels" --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  nixl-cu13==1.5.1 fastapi starlette pydantic pydantic_core annotated-types \
  typing-inspection uvicorn pyzmq msgspec opentelemetry-api
rm -rf .devsite && mkdir -p .devsite/site .devsite/tok "$wheels/nixl"
for w in "$wheels"/*.whl; do
  case $w in *nixl_cu13*) unzip -q "$w" -d "$wheels/nixl" ;; *) unzip -q "$w" -d .devsite/site ;; esac
done
.venv/bin/python - "$wheels/nixl" .devsite/site <<'EOF'
"""Copy nixl_cu13 with the UCX plugin and the shared libraries it needs, nothing else."""
import re, shutil, subprocess, sys
from pathlib import Path

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
libs = {p.name: p for d in ("nixl_cu13.libs", ".nixl_cu13.mesonpy.libs")
        for p in sorted((src / d).rglob("*")) if p.is_file()}
ucx = src / "nixl_cu13.libs" / "ucx"
todo = [*(src / "nixl_cu13").glob("*.so"), *src.glob("*nixl_cu13*libs/*/libplugin_UCX.so"),
        *(ucx / f"lib{m}.so.0.0.0" for m in ("uct_cma", "uct_cuda", "ucm_cuda"))]
keep = set(todo) | {ucx / f"lib{m}.la" for m in ("uct_cma", "uct_cuda", "ucm_cuda")}
while todo:
    elf = subprocess.run(["readelf", "-d", todo.pop()], capture_output=True, text=True).stdout
    for name in re.findall(r"NEEDED.*\[(.*)\]", elf):
        if name in libs and libs[name] not in keep:
            keep.add(libs[name]), todo.append(libs[name])
shutil.copytree(src / "nixl_cu13", dst / "nixl_cu13")
for p in keep - set((src / "nixl_cu13").glob("*")):
    (dst / p.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(p, dst / p.relative_to(src))
EOF
find .devsite/site -name '*.so*' -type f -exec strip --strip-unneeded {} +
model=$(.venv/bin/python -c "from pdserve.model.loader import resolve; print(resolve(None))")
cp "$model"/{config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja} .devsite/tok/
du -sh .devsite
