"""Times one repetition x one N x one tuner of configs/multidim_tuning.py:spec (group family)."""
import json, sys, time
import jax, numpy as np
from configs import multidim_tuning as m
from experiments import multidim_tuning as e
from lowrank_jax import tuning

c = m.get_config("spec,parts=group")
pen, sample, iters = e.family(c, "group")
inst = sample(jax.random.key(0), max(c.data.ns))
losses = e.PrefixLosses(c, inst, pen, iters)
out = {}
def clock(name, fn):
    w, p = time.perf_counter(), time.process_time()
    r = fn()
    out[name] = {"wall_s": round(time.perf_counter() - w, 1), "cpu_s": round(time.process_time() - p, 1),
                 "evals": int(r.num_evals)}
    print(name, out[name], flush=True)
for spec in sys.argv[1:]:
    method, p, n = spec.split(":")
    clock(spec, lambda: e.tune(c, method, int(p), losses, 1, int(n)))
print(json.dumps(out))
