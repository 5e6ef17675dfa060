#!/usr/bin/env bash
# Session 14: the extend prefix tile end to end, `attnserve.bench.prefix` on a GPU (Llama-3-8B
# shape, dummy weights), the default (128-key prefix tiles) and then the same tree with
# the tile off (`extend_config(has_prefix=False)` forced: the kernel before session 14).
set -u
OUT=${OUT:-/tmp/out}
export PYTHONPATH=src PYTHONUNBUFFERED=1
A="--device cuda --load-format dummy --model llama-3-8b --requests ${N:-16} --prefix-len 8192 --unique-len 512 --output-len 4"
mkdir -p "$OUT/new" "$OUT/old"
timeout ${T:-170} python3 -m attnserve.bench.prefix $A --out "$OUT/new" 2>&1 | grep -E "s \(runs|shared /"
timeout ${T:-170} python3 -c "
import sys, runpy
import attnserve.attention.triton_ops.extend_attention as m
orig = m.extend_config
m.extend_config = lambda *a, **k: orig(*a, **{**k, 'has_prefix': False})
sys.argv = ['prefix'] + '''$A --out $OUT/old'''.split()
runpy.run_module('attnserve.bench.prefix', run_name='__main__')
" 2>&1 | grep -E "s \(runs|shared /"
