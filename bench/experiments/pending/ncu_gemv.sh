#!/usr/bin/env bash
# Nsight Compute on a 27B decode step's GEMVs (GPU machine, carry .whl): the first 6 one-row
# gemv_bulk launches of gpu_qwen35_profile.py and the first 5 4-row gemv_bulk_mt ones (a verify
# pass's), --set full; the details page's throughput / issue / occupancy lines printed, every
# metric as CSV under $OUT. Usage: bash bench/experiments/pending/ncu_gemv.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/root/cupycache PYTHONPATH=/tmp/site:$PWD
n=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for run in "gemv_bulk:6:--rows 1:b1" "gemv_bulk_mt:5:--rows 4:r4"; do
  IFS=: read k c a tag <<< "$run"
  timeout 200 $n --clock-control none -k "regex:^$k\$" -c $c --set full -f -o "$OUT/$tag" \
    python3 bench/experiments/gpu_qwen35_profile.py $a > "$OUT/ncu-$tag.out" 2>&1
  $n --import "$OUT/$tag.ncu-rep" --page details 2>&1 > "$OUT/ncu-$tag.log"
  grep -E "gemv_bulk|Grid Size|Duration|DRAM Throughput|Memory Throughput|Issue Slots Busy|Issued Ipc Active|Warp Cycles Per Issued|Achieved Occupancy|Registers Per|Dynamic Shared|One or More Eligible" "$OUT/ncu-$tag.log" | sed "s/^/$tag /" | cut -c1-150 | head -90
  $n --import "$OUT/$tag.ncu-rep" --page raw --csv > "$OUT/raw-$tag.csv" 2>&1
done
# the stall reasons per issued instruction, largest first, for each profiled launch
for tag in b1 r4; do
  python3 - "$OUT/raw-$tag.csv" "$tag" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head, body = rows[0], rows[2:]
cols = [i for i, h in enumerate(head) if "issue_stalled" in h and h.endswith("per_issue_active.ratio")]
for r in body:
    name = r[head.index("Kernel Name")][:60] if "Kernel Name" in head else "?"
    vals = sorted(((float(r[i].replace(",", "") or 0), head[i]) for i in cols), reverse=True)[:7]
    print(sys.argv[2], name, " ".join(f"{h.split('stalled_')[1].split('_per')[0]}={v:.2f}" for v, h in vals))
PY
done
