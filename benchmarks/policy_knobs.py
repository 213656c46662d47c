"""How much of the hindsight oracle's gain would cheap changes to a trained run's policies take? (not a test)

    PYTHONPATH=<tree parent> .venv/bin/python benchmarks/policy_knobs.py RUN_DIR [--split heldout]
        [--seeds 3] [--shifts -2,-1,-0.5,0,0.5,1,2] [--tilts -0.3,0,0.3]

RUN_DIR: a demo run (`RUN/seed<k>/policies.json`, `RUN/traces/<split>/`, and for the held-out split
`RUN/eval/report.json`, whose kept prompts and AR reference the report's replay uses; other splits replay every
prompt against the profile's AR reference). Everything is exact replay (`envs.oracle.replay_controller`), so it
costs seconds and no timing noise. Printed, as speedups over AR and shares of the oracle's gain over AR:

- each seed's ltd after behaviour cloning only (`RUN/seed<k>/bc/`) and after BC + PPO, and an **ensemble** of the
  seeds (their logits averaged: one wider MLP with block-diagonal hidden layers, one actor call per decision);
- the deployed seed with its STOP logit shifted by each --shifts value and its size logits tilted by t x (index of
  the size): shift > 0 stops earlier, tilt > 0 verifies more; the best cell overall tells whether the policy is
  calibrated, and **each prompt at its own best cell in hindsight** bounds what per-prompt calibration of these
  two knobs (an online bandit over the generation, say) could take at most.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from specpilot.envs.oracle import replay_controller, replay_oracle
from specpilot.envs.replay import ReplayModel
from specpilot.eval.replay_eval import gain_share
from specpilot.policies.actor import Actor
from specpilot.policies.learned import STOP, LearnedController
from specpilot.policies.ppo import load_run_controllers


def ensemble_actor(actors: list[Actor]) -> Actor:
    """One Actor whose logits are the mean of `actors`' logits (same layer count and activations): the first layers
    stacked, the hidden ones block-diagonal, the last ones side by side divided by their number."""
    linears = [[layer for layer in a.layers if layer[0] == "linear"] for a in actors]
    activations = [layer for layer in actors[0].layers if layer[0] == "activation"]
    n, layers = len(linears[0]), []
    for k in range(n):
        weights = [torch.as_tensor(lin[k][1]) for lin in linears]
        biases = [torch.as_tensor(lin[k][2]) for lin in linears]
        if k == 0:
            weight, bias = torch.cat(weights, 0), torch.cat(biases, 0)
        elif k < n - 1:
            weight, bias = torch.block_diag(*weights), torch.cat(biases, 0)
        else:
            weight, bias = torch.cat(weights, 1) / len(weights), sum(biases) / len(biases)
        layers.append(("linear", weight, bias))
        if k < n - 1:
            layers.append(activations[k])
    return Actor(layers, source="ensemble")


def shifted_actor(actor: Actor, delta: list[float]) -> Actor:
    """`actor` with `delta` added to its last layer's bias (its logits)."""
    layers = list(actor.layers)
    last = max(i for i, layer in enumerate(layers) if layer[0] == "linear")
    bias = torch.as_tensor(layers[last][2]).clone()
    layers[last] = ("linear", layers[last][1], bias + torch.as_tensor(delta, dtype=bias.dtype))
    return Actor(layers, source="shifted")


def _like(base: LearnedController, depth_actor: Actor, size_actor: Actor) -> LearnedController:
    return LearnedController(depth_actor, size_actor, base.depth_spec, base.size_spec, base.size_actions,
                             base.fallback, name="knob")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--split", default="heldout")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--shifts", default="-2,-1,-0.5,0,0.5,1,2")
    ap.add_argument("--tilts", default="-0.3,0,0.3")
    args = ap.parse_args(argv)
    run = args.run_dir
    model = ReplayModel(run / "traces" / args.split)
    if args.split == "heldout":
        replay = json.loads((run / "eval" / "report.json").read_text())["replay"]
        kept, ar_tps = replay["prompts_kept"], 1.0 / replay["ar_seconds_per_token"]
    else:
        kept, ar_tps = list(range(model.num_prompts)), 1.0 / model.profile.meta["ar_seconds_per_token"]
    oracle = replay_oracle(model, prompts=kept)
    oracle_tps = oracle["oracle"]["tokens_per_s"]

    def line(label: str, tokens: float, time_s: float) -> None:
        tps = tokens / time_s
        print(f"  {label:34s} {tps / ar_tps:.3f}x AR, {gain_share(tps, oracle_tps, ar_tps):6.1%} of the oracle's gain")

    def per_prompt(controller) -> np.ndarray:
        out = [replay_controller(model, controller=controller, prompts=[i]) for i in kept]
        return np.array([(o["tokens"], o["time_s"]) for o in out])

    print(f"{run} {args.split}: {len(kept)} prompts; oracle {oracle_tps / ar_tps:.3f}x AR, each prompt at its own "
          f"best static {oracle['per_prompt_static']['tokens_per_s'] / ar_tps:.3f}x")
    chosen = json.loads((run / "seeds.json").read_text()).get("chosen", 0) if (run / "seeds.json").is_file() else 0
    seeds = [load_run_controllers(run / f"seed{k}", off_switch=False)["ltd"] for k in range(args.seeds)]
    for k, controller in enumerate(seeds):
        if (run / f"seed{k}" / "bc" / "policies.json").is_file():
            cloned = load_run_controllers(run / f"seed{k}" / "bc", off_switch=False)["ltd"]
            line(f"seed {k}, behaviour cloning only", *per_prompt(cloned).sum(0))
        line(f"seed {k}, BC + PPO" + (" (deployed)" if k == chosen else ""), *per_prompt(controller).sum(0))
    ens = _like(seeds[0], ensemble_actor([c.depth_actor for c in seeds]), ensemble_actor([c.size_actor for c in seeds]))
    line(f"ensemble of the {len(seeds)} seeds", *per_prompt(ens).sum(0))
    base = seeds[chosen]
    cells = {}
    for shift in (float(v) for v in args.shifts.split(",")):
        for tilt in (float(v) for v in args.tilts.split(",")):
            stop_delta = [0.0, 0.0]
            stop_delta[STOP] = shift
            sizes = [tilt * i for i in range(len(base.size_actions))]
            cells[(shift, tilt)] = per_prompt(_like(base, shifted_actor(base.depth_actor, stop_delta),
                                                    shifted_actor(base.size_actor, sizes)))
    best = max(cells, key=lambda c: cells[c][:, 0].sum() / cells[c][:, 1].sum())
    line("deployed, no shift, no tilt", *cells.get((0.0, 0.0), per_prompt(base)).sum(0))
    line(f"best cell: stop {best[0]:+g}, size tilt {best[1]:+g}", *cells[best].sum(0))
    rows = np.array([min((cell[j] for cell in cells.values()), key=lambda r: r[1] / r[0]) for j in range(len(kept))])
    line("each prompt at its best cell", *rows.sum(0))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
