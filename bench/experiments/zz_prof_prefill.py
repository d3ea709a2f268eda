import cProfile, pstats, sys
import numpy as np, cupy as cp
from ninfer.bench.model import PAGE_SIZE, load, pages
from ninfer.engine.models.llama import ForwardBatch
p = int(sys.argv[1])
bm = load(None, "cupy", max_positions=p + 64, max_batch=1, cuda_graph=False)
kv = bm.new_kv(1, p)
ids = np.random.default_rng(1).integers(0, bm.config.vocab_size, size=p).tolist()
def one():
    b = ForwardBatch.from_sequences([ids], [0], [list(range(pages(p)))], PAGE_SIZE, bm.slots(kv, 1))
    return bm.base.forward(b, kv)
for _ in range(3): one()
cp.cuda.Device().synchronize()
import time
t = time.perf_counter()
for _ in range(10): one()
t1 = time.perf_counter(); cp.cuda.Device().synchronize(); t2 = time.perf_counter()
print(f"host issue {1e3*(t1-t)/10:.2f} ms a pass, drain {1e3*(t2-t1):.2f} ms")
pr = cProfile.Profile(); pr.enable()
for _ in range(10): one()
cp.cuda.Device().synchronize()
pr.disable()
st = pstats.Stats(pr); st.sort_stats("tottime").print_stats(30)
st.sort_stats("cumtime").print_stats(40)
