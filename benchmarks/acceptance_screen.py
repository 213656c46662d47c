"""Does the EAGLE-3 head's hidden state tell whether a drafted token will be accepted, beyond what a policy already
sees? (not a test; a screen before adding a feature to the observation)

    PYTHONPATH=<tree parent> .venv/bin/python benchmarks/acceptance_screen.py [--new-tokens 48] [--depth 8]
        [--fit train,validation] [--test heldout_code]

On the embedded target with its EAGLE-3 head (CPU, fp32): each prompt's greedy continuation is generated, and from
every position of it the head drafts its greedy chain `--depth` levels deep (committed entries fed with the
target's features, as the decoder feeds them). Level k is labelled 1 when the chain's tokens 1..k all equal the
target's greedy tokens (accepted length >= k): what a depth policy must guess before verifying. Features per level:

- scalars: the chosen token's probability, its margin over the second, the entropy / 5, the chain's cumulative
  log-prob / 20 (floored at -1), k / depth (the drafter features a policy observes, `policies.observation`);
- hidden: the head's normed output state that produced level k's distribution (what the lm_head reads);
- history: the accepted length of the chain drafted one position earlier and an exponential average of it
  (decay 0.7) over the generation so far (a policy observes the previous cycle's accepted length and the running
  acceptance rate);
- probe: a logistic probe on the hidden state alone (fitted on the first --fit split), one scalar.

Classifiers (logistic, and a [64] ReLU MLP; 500 full-batch Adam steps at two weight decays, inputs standardised on
the fit rows) are fitted on the --fit splits and scored on --test: AUC and log loss. Machine load moves only the
timing line, not the numbers.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from specpilot.drafting.cache import crop_to
from specpilot.drafting.pair import ModelPair
from specpilot.eval.suites import load_suite

HISTORY_DECAY = 0.7
DECAYS = (1e-4, 1e-2)  # Adam weight decays: the features' best fits differ (the hidden state's 384 inputs want more)


@torch.no_grad()
def chain_rows(pair: ModelPair, prompt_ids: list[int], new_tokens: int, depth: int):
    """(scalars [n, 5], hidden [n, H], labels [n], level [n]) of every drafted level of every chain of one prompt."""
    head, target = pair.eagle, pair.target
    seq = target.generate(torch.tensor([prompt_ids]), max_new_tokens=new_tokens, do_sample=False)[0]
    length, prompt_len = seq.numel(), len(prompt_ids)
    states = target(seq[None], output_hidden_states=True).hidden_states
    fused = head.fc(torch.cat([states[i][0] for i in head.aux_layer_ids], dim=-1))  # [length, H]
    cache = head.new_cache()
    if prompt_len > 2:  # committed token j has its head entry at position j - 1, fed with the feature at j - 1
        head(seq[None, 1:prompt_len - 1], fused[None, :prompt_len - 2],
             position_ids=torch.arange(prompt_len - 2)[None], cache=cache)
    scalars, hidden, labels, levels = [], [], [], []
    for root in range(prompt_len - 1, length - 1):
        crop_to(cache, root - 1)
        logits, out = head(seq[None, root:root + 1], fused[None, root - 1:root],
                           position_ids=torch.tensor([[root - 1]]), cache=cache)
        cumulative, alive = 0.0, True
        for k in range(1, min(depth, length - 1 - root) + 1):
            logq = torch.log_softmax(logits[0, -1], -1)
            top = torch.topk(logq, 2)
            p1, p2 = float(top.values[0].exp()), float(top.values[1].exp())
            token = head.to_target_ids(top.indices[:1])
            cumulative += float(top.values[0])
            alive = alive and int(token) == int(seq[root + k])
            scalars.append([p1, p1 - p2, float(-(logq.exp() * logq).sum()) / 5.0, max(cumulative / 20.0, -1.0),
                            k / depth])
            hidden.append(head.norm(out[0, -1]).float().numpy())
            labels.append(float(alive))
            levels.append(k)
            if k < depth:
                logits, out = head(token[None], out[:, -1:], position_ids=torch.tensor([[root - 1 + k]]), cache=cache)
        crop_to(cache, root)
    return (np.array(scalars, np.float32), np.array(hidden, np.float32), np.array(labels, np.float32),
            np.array(levels))


def history(labels: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """[n, 2]: per row, the previous chain's accepted length and its running average, both / max level."""
    starts = np.flatnonzero(levels == 1)
    accepted = np.add.reduceat(labels, starts)
    previous, average = np.zeros(len(starts)), np.zeros(len(starts))
    for i in range(1, len(starts)):
        previous[i] = accepted[i - 1]
        average[i] = HISTORY_DECAY * average[i - 1] + (1 - HISTORY_DECAY) * accepted[i - 1]
    chain = np.cumsum(levels == 1) - 1
    return (np.stack([previous[chain], average[chain]], 1) / levels.max()).astype(np.float32)


def split_rows(pair: ModelPair, split: str, new_tokens: int, depth: int) -> dict:
    parts = [chain_rows(pair, pair.encode(p.prompt), new_tokens, depth) for p in load_suite(split)]
    return {"scalars": np.concatenate([p[0] for p in parts]), "hidden": np.concatenate([p[1] for p in parts]),
            "labels": np.concatenate([p[2] for p in parts]),
            "history": np.concatenate([history(p[2], p[3]) for p in parts]), "prompts": len(parts)}


def auc(score: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney; ties broken by order, fine for continuous scores)."""
    ranks = np.empty(len(score))
    ranks[np.argsort(score)] = np.arange(1, len(score) + 1)
    pos = labels == 1
    return float((ranks[pos].sum() - pos.sum() * (pos.sum() + 1) / 2) / (pos.sum() * (~pos).sum()))


def fit_score(x: np.ndarray, y: np.ndarray, x_test: np.ndarray, *, hidden: int = 0, weight_decay: float = 1e-2,
              epochs: int = 500, seed: int = 0) -> np.ndarray:
    """A logistic (hidden=0) or one-hidden-layer classifier fitted on (x, y); its logits on x_test."""
    torch.manual_seed(seed)
    mean, std = x.mean(0), x.std(0) + 1e-6
    inputs = torch.tensor((x - mean) / std)
    net = torch.nn.Linear(x.shape[1], 1) if not hidden else torch.nn.Sequential(
        torch.nn.Linear(x.shape[1], hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
    opt = torch.optim.Adam(net.parameters(), lr=3e-3, weight_decay=weight_decay)
    target = torch.tensor(y)[:, None]
    for _ in range(epochs):
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(net(inputs), target).backward()
        opt.step()
    with torch.no_grad():
        return net(torch.tensor((x_test - mean) / std))[:, 0].numpy()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--fit", default="train,validation", help="comma-separated bundled suites to fit on")
    p.add_argument("--test", default="heldout_code", help="bundled suite to score on")
    args = p.parse_args()
    torch.set_num_threads(2)
    pair = ModelPair.from_pretrained(eagle="embedded")
    started = time.perf_counter()
    fit_splits = args.fit.split(",")
    data = {s: split_rows(pair, s, args.new_tokens, args.depth) for s in [*fit_splits, args.test]}
    print(f"chains drafted in {time.perf_counter() - started:.0f} s: "
          + ", ".join(f"{s} {d['prompts']} prompts / {len(d['labels'])} levels" for s, d in data.items()))
    fit = {k: np.concatenate([data[s][k] for s in fit_splits]) for k in ("scalars", "hidden", "labels", "history")}
    test = data[args.test]
    print(f"accepted share: fit {fit['labels'].mean():.3f}, test {test['labels'].mean():.3f}")
    first = data[fit_splits[0]]
    probe = fit_score(first["hidden"], first["labels"], np.concatenate([fit["hidden"], test["hidden"]]))
    fit["probe"], test["probe"] = probe[:len(fit["labels"]), None], probe[len(fit["labels"]):, None]
    feature_sets = {"scalars": ("scalars",), "scalars + hidden": ("scalars", "hidden"),
                    "scalars + history": ("scalars", "history"),
                    "scalars + history + probe": ("scalars", "history", "probe"),
                    "scalars + history + hidden": ("scalars", "history", "hidden")}
    y_test = torch.tensor(test["labels"])
    print(f"{'features':28s} {'model':9s} " + "  ".join(f"weight decay {wd:g}: AUC, log loss" for wd in DECAYS))
    for name, keys in feature_sets.items():
        x, x_test = (np.hstack([d[k] for k in keys]) for d in (fit, test))
        for hidden in (0, 64):
            cells = []
            for weight_decay in DECAYS:
                logits = fit_score(x, fit["labels"], x_test, hidden=hidden, weight_decay=weight_decay)
                loss = float(torch.nn.functional.binary_cross_entropy_with_logits(torch.tensor(logits), y_test))
                cells.append(f"{auc(logits, test['labels']):.3f}, {loss:.3f}")
            model = f"MLP [{hidden}]" if hidden else "logistic"
            print(f"{name:28s} {model:9s} " + "  ".join(f"{c:>33s}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
