# Nsight Compute on attn_prefill_wgmma alone (attn_prefill_micro.py, 2,048 tokens over 30,720)
# in the tree it runs in: the details page, the stall reasons and tensor-pipe use, and the
# source page (SASS lines with their warp-stall samples) as sass.csv under $OUT (~15 s).
set -u
out=${OUT:-/tmp/out}; mkdir -p $out
export PYTHONPATH=/tmp/site:$PWD CUPY_CACHE_DIR=/root/cupycache PYTHONUNBUFFERED=1
[ -e /tmp/site/trio ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
n=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
$n --version | tail -1
timeout 300 $n --clock-control none -k regex:attn_prefill_wgmma -c 1 --set full -f -o $out/attn \
  python3 bench/experiments/attn_prefill_micro.py --tokens 2048 --depth 30720 --tilings wgmma > $out/ncu-run.out 2>&1
tail -3 $out/ncu-run.out
$n --import $out/attn.ncu-rep --page details > $out/details.txt 2>&1
grep -E "Duration|Throughput|Shared|Stall|Warp Cycles|Issued|Occupancy|Registers|Bank|Pipe|Tensor|Executed Ipc|L2 Hit|Eligible|Active Warps|No Eligible" $out/details.txt | head -70
$n --import $out/attn.ncu-rep --page raw --csv > $out/raw.csv 2>&1
$n --import $out/attn.ncu-rep --page source --csv --print-source sass > $out/sass.csv 2>&1; echo "sass rc $? $(wc -l < $out/sass.csv)"
python3 - $out/raw.csv <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
if len(rows) >= 3:
    h, u, v = rows[0], rows[1], rows[2]
    st = [(float(v[i].replace(',', '')), h[i]) for i in range(len(h))
          if 'smsp__average_warp' in h[i] and 'issue_stalled' in h[i] and 'ratio' in h[i] and v[i].replace(',', '').replace('.', '').isdigit()]
    for x, name in sorted(st, reverse=True)[:14]: print(f"stall {x:8.2f} {name}")
    for i in range(len(h)):
        if any(k in h[i] for k in ('pipe_tensor', 'l1tex__data_bank', 'sm__throughput', 'lts__t_bytes.sum.per_second', 'smsp__inst_executed_pipe')) and 'pct' in h[i]:
            print(h[i], v[i])
PY
