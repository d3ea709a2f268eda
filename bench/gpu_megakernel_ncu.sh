#!/usr/bin/env bash
# Stall reasons of the persistent decode kernel's warps (Nsight Compute), the next step named in
# bench/gpu_notes.md, session 8. On the GPU machine (Firecracker runtime: ncu reads counters
# there with --clock-control none, ../.library/device/H200.md), with PYTHONPATH set up:
#   bash bench/gpu_megakernel_ncu.sh MODEL.gguf OUTDIR [WxUPW]
# Profiles one decode_layers launch (the second one: the first compiles and warms up) and writes
# OUTDIR/mk.ncu-rep plus OUTDIR/mk_details.txt (warp-state, scheduler and memory sections).
set -euo pipefail
model=$1; out=$2; shape=${3:-base}
mkdir -p "$out"
ncu --clock-control none -k regex:decode_layers -s 1 -c 1 \
    --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
    --section SpeedOfLight --section LaunchStats --section Occupancy \
    -f -o "$out/mk" \
    python3 bench/gpu_megakernel_trace.py "$model" --steps 2 --variants "$shape" > "$out/mk_run.txt" 2>&1
ncu --import "$out/mk.ncu-rep" --page details > "$out/mk_details.txt"
grep -E "Stall|Warp Cycles|Issued|Eligible|Active Warps|Duration|Throughput" "$out/mk_details.txt" | head -60
