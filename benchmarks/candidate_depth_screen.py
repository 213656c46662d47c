"""Does each sorted candidate's depth in the draft tree help a size policy, beyond the sorted scores? (not a test;
the screen that preceded the `candidate_depths` observation feature)

    PYTHONPATH=<tree parent> .venv/bin/python benchmarks/candidate_depth_screen.py RUN [--seeds 3] [--epochs 60]

From a run's recorded traces (RUN/traces/{train,validation,heldout}: a demo's), every position t and depth d gives
one example: the top-31 candidates of the tree drafted d levels deep, sorted by score (clipped at -20, / 20), plus
depth, progress and a history proxy (the accepted length of the previous position at d=4, V=15, and its running
mean); with `+depth` also each sorted candidate's tree depth / max_depth. Targets: the exact accepted length
acc(t, d, V) for every CPU verification size V (`policies.observation.CPU_SIZE_ACTIONS`). A [128, 128] MLP regression
is fitted on train + validation and scored on heldout: the mean squared error, and the size decision it implies
(argmax over V of (predicted accepted + 1) / (draft time of d levels + verify time of V, both from the trace's
latency profile)) as the share of the hindsight best size's tokens/s. Replay is exact, so load moves nothing here.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from specpilot.drafting.cycle_math import num_candidates
from specpilot.envs.replay import ReplayModel
from specpilot.policies.observation import CPU_SIZE_ACTIONS

TOP = 31


def examples(trace_dir) -> dict[str, np.ndarray]:
    """Features (with and without depths), targets and per-size cycle times of every (position, depth)."""
    model = ReplayModel(trace_dir)
    width, max_depth = model.trace.width, model.trace.max_depth
    sizes = [v for v in CPU_SIZE_ACTIONS if v <= model.trace.max_size]
    out: dict[str, list] = {"plain": [], "depths": [], "acc": [], "time": []}
    for i in range(model.num_prompts):
        tab = model.tables(i)
        history = []
        for t in range(tab.n):
            prev = float(tab.acc[t - 1, 3, 15]) if t else 0.0
            rate = float(np.mean(history)) if history else 1.0
            history.append(tab.acc[t, 3, 15] / 4)
            for d in range(1, max_depth + 1):
                state = tab.state(t, d)
                scores, depths = state.candidate_scores[:TOP], state.candidate_depths[:TOP]
                k = scores.shape[0]
                s = np.full(TOP, -1.0)
                s[:k] = np.clip(scores / 20.0, -1.0, 0.0)
                dep = np.zeros(TOP)
                dep[:k] = depths / max_depth
                base = np.concatenate([s, [d / max_depth, t / max(tab.n, 1), prev / max_depth, rate]])
                out["plain"].append(base)
                out["depths"].append(np.concatenate([base, dep]))
                out["acc"].append([tab.acc[t, d - 1, min(v, num_candidates(width, d))] for v in sizes])
                out["time"].append(model.draft_time(1, d) + tab.verify[t, [min(v, num_candidates(width, d))
                                                                        for v in sizes]])
    return {k: np.asarray(v, dtype=np.float32) for k, v in out.items()}


def fit_predict(x: np.ndarray, y: np.ndarray, x_test: np.ndarray, seed: int, epochs: int) -> np.ndarray:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(x.shape[1], 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                              torch.nn.ReLU(), torch.nn.Linear(128, y.shape[1]))
    opt = torch.optim.Adam(net.parameters(), 1e-3, weight_decay=1e-5)
    xt, yt = torch.tensor(x), torch.tensor(y)
    for _ in range(epochs):
        perm = torch.randperm(len(xt))
        for b in range(0, len(xt), 256):
            idx = perm[b:b + 256]
            loss = ((net(xt[idx]) - yt[idx]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        return net(torch.tensor(x_test)).numpy()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", help="a run directory with traces/{train,validation,heldout} (e.g. runs/demo)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=60)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    fit = [examples(f"{args.run}/traces/{split}") for split in ("train", "validation")]
    test = examples(f"{args.run}/traces/heldout")
    y = np.concatenate([f["acc"] for f in fit])
    rate = (test["acc"] + 1.0) / test["time"]
    best = rate.max(axis=1).mean()
    print(f"{len(y)} fit examples, {len(test['acc'])} held-out; variance of acc {test['acc'].var(axis=0).mean():.3f}")
    for name in ("plain", "depths"):
        x = np.concatenate([f[name] for f in fit])
        mse, eff = [], []
        for seed in range(args.seeds):
            pred = fit_predict(x, y, test[name], seed, args.epochs)
            mse.append(float(((pred - test["acc"]) ** 2).mean()))
            pick = np.argmax((pred + 1.0) / test["time"], axis=1)
            eff.append(float(rate[np.arange(len(pick)), pick].mean() / best))
        label = "scores" if name == "plain" else "+depth"
        print(f"{label:7s} mse {np.round(mse, 4).tolist()}  size decision at {np.round(eff, 4).tolist()} of the "
              "hindsight best size's tokens/s")


if __name__ == "__main__":
    main()
