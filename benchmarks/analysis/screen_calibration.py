"""Screened OAR-P's calibration, simulated offline on ``oar eval-attribution`` traces (issue 13).

The traces' JSON holds exact OAR-P and 1-draw OAR-G scores of every token, so any selection and calibration can be
replayed without the model: per trace and fraction f, the screen's (OAR-G) top ceil(f L) tokens plus a random
ceil(0.05 L) of the others keep their exact scores, the others get the calibrated screen; 20 sample draws per trace.
Schemes: ls_sample (oar's: least squares through 0 on the sample), ls_all (on every masked token), isotonic (a
monotone map fitted on every masked token), ls_sample_capped (capped at the sample's largest exact score), zero
(unmasked tokens below every masked one, in screen order). Prints mean Spearman, top-10% overlap and recall@10%
minus exact's.

Usage: python benchmarks/analysis/screen_calibration.py docs/attribution_eval/arithmetic.json
"""
import json
import math
import random
import sys
import zlib

import numpy as np

from oar.app.eval_attribution import recall_at, top_overlap
from oar.app.stats import spearman

d = json.load(open(sys.argv[1]))
traces = d["traces"]

def iso_fit(x, y):
    # isotonic nondecreasing regression of y on x (PAV), returns function via interpolation
    o = np.argsort(x, kind="stable"); xs, ys = np.asarray(x)[o], np.asarray(y, float)[o]
    blocks = [[ys[i], 1.0, xs[i], xs[i]] for i in range(len(xs))]
    out = []
    for b in blocks:
        out.append(b)
        while len(out) > 1 and out[-2][0] > out[-1][0]:
            v2, w2, lo2, hi2 = out.pop(); v1, w1, lo1, hi1 = out.pop()
            out.append([(v1*w1+v2*w2)/(w1+w2), w1+w2, lo1, hi2])
    px = []; py = []
    for v, w, lo, hi in out:
        px += [lo, hi]; py += [v, v]
    return lambda q: np.interp(q, px, py)

def scheme(name, s, e, top, samp):
    L = len(s); chosen = sorted(set(top) | set(samp)); rest = [j for j in range(L) if j not in set(chosen)]
    out = np.zeros(L); out[chosen] = e[chosen]
    if not rest: return out
    if name == "ls_sample":
        idx = samp if samp and (s[samp]**2).sum() > 0 else chosen
        a = max(0.0, (s[idx]*e[idx]).sum() / max((s[idx]**2).sum(), 1e-300))
        out[rest] = a * s[rest]
    elif name == "ls_all":
        a = max(0.0, (s[chosen]*e[chosen]).sum() / max((s[chosen]**2).sum(), 1e-300))
        out[rest] = a * s[rest]
    elif name == "isotonic":
        f = iso_fit(s[chosen], e[chosen]); out[rest] = np.maximum(f(s[rest]), 0)
    elif name == "ls_sample_capped":
        idx = samp if samp and (s[samp]**2).sum() > 0 else chosen
        a = max(0.0, (s[idx]*e[idx]).sum() / max((s[idx]**2).sum(), 1e-300))
        cap = e[samp].max() if samp else e[chosen].min()
        out[rest] = np.minimum(a * s[rest], cap)
    elif name == "zero":
        out[rest] = 0.0 + 1e-12 * s[rest]
    return out

for f in (0.05, 0.1, 0.2, 0.3):
    res = {}
    for name in ("ls_sample", "ls_all", "isotonic", "ls_sample_capped", "zero"):
        rhos, recs, ovs = [], [], []
        for t in traces:
            s = np.array(t["scores"]["oar_g1/answer_mean"]); e = np.array(t["scores"]["oar_p/answer_mean"])
            L = len(s)
            order = sorted(range(L), key=lambda i: (-s[i], i)); ntop = min(L, math.ceil(f*L))
            top = sorted(order[:ntop]); others = order[ntop:]
            for rep in range(20):
                r2 = random.Random(zlib.crc32(f"{t['problem_id']}|{rep}".encode()))
                samp = sorted(r2.sample(others, min(len(others), math.ceil(0.05*L))))
                out = scheme(name, s, e, top, samp)
                rho = spearman(out.tolist(), e.tolist())
                if rho is not None: rhos.append(rho)
                ovs.append(top_overlap(out.tolist(), e.tolist(), 10))
                if any(t["causal"]):
                    recs.append(recall_at(out.tolist(), t["causal"], 10) - recall_at(e.tolist(), t["causal"], 10))
        res[name] = (np.mean(rhos), np.mean(ovs), np.mean(recs))
    print(f, {k: tuple(round(x, 3) for x in v) for k, v in res.items()})
