"""Recording replay traces (and a latency profile) for a task: `specpilot record`.

Under greedy decoding the emitted text does not depend on (depth, size), so one recording per prompt gives the exact
accepted length of ANY depth/size choice at ANY position. Recording uses the decoder's own components:

1. the target's greedy continuation from `autoregressive_generate` (max_new_tokens, plus max_depth tokens of
   look-ahead past the budget or past EOS, so the last cycle's accepted length is exact too);
2. for every position t of the emitted continuation, the draft tree rooted at the last committed token grown to
   max_depth with `TreeDrafter` (one token committed per position: causal attention makes this the tree the live
   decoder drafts after any multi-token catch-up, up to float rounding);
3. per position: every candidate's score (node ids are level by level, so a node's depth follows from its id),
   the drafter's last_top_prob / last_entropy after every level, and for the on-path nodes (tokens from the root
   equal continuation[t:t+k]) their rank among the candidates of depth <= d in verification order (tree.ranked()).

accepted(t, d, V) = #{k <= d : rank_d(on-path node at depth k) < V} (verification sets are ancestor-closed and the
on-path nodes form a chain). emitted = min(accepted + 1, tokens left up to and including EOS / max_new_tokens).

Files: trace.npz (arrays below) + trace.json (header) + profile.json (`specpilot.envs.profile.LatencyProfile`).
`record_task` records in shards of prompts on an executor (this process, or Ray workers) and merges them: the
trace equals a recording of all prompts at once; OUT/shards/ keeps the finished shards, so a re-run resumes.

    trace.npz
      prompt_tokens [sum P_i] int32, prompt_offsets [P+1]      the prompts' token ids
      continuation [sum C_i] int32, continuation_offsets [P+1] greedy continuation incl. look-ahead
      eos_at [P] int32            index of the first EOS in the continuation, -1 if none within the budget
      position_offsets [P+1]      rows of prompt i: position_offsets[i] .. position_offsets[i+1] (t = 0..n_i-1)
      scores [N, C] float32       candidate scores by node id (C = W + (D-1) W^2)
      top_prob, entropy [N, D]    drafter features after level d (what DraftState carries)
      onpath_rank [N, D, D] int16 [n, d-1, k-1]: rank of the on-path node at depth k among nodes of depth <= d;
                                  NO_RANK when k > d or no on-path node at depth k
"""
from __future__ import annotations

import json
import sys
import time
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from specpilot.drafting.cycle_math import clip_size, first_end, level_bounds, num_candidates
from specpilot.drafting.errors import InputFileError
from specpilot.artifacts.contract import same_pair
from specpilot.artifacts.profile import profile_path
from specpilot.artifacts.trace import (ARRAYS_FILE, HEADER_FILE, RECORD_AGAIN, TRACE_VERSION,  # noqa: F401
                                       TraceHeader)
from specpilot.drafting.executor import ShardTask, as_executor, shard_ranges
from specpilot.drafting.files import atomic_path, atomic_write_json, atomic_write_text, check_writable, read_json
from specpilot.drafting.folder_lock import holds_output
from specpilot.envs import shards as sh
from specpilot.envs.profile import share_of

NO_RANK = np.iinfo(np.int16).max
TIMING_DIR = "timing"  # OUT/shards/timing/: the profile samples and AR timing measured apart from the trace workers


@dataclass
class Trace:
    """A recorded task (see the module docstring for the arrays). Load with `Trace.load(dir_or_npz)`."""

    header: dict
    arrays: dict[str, np.ndarray]
    path: Path | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    # -- shape ----------------------------------------------------------------------------------------------------------
    @property
    def width(self) -> int:
        return int(self.header["tree"]["width"])

    @property
    def max_depth(self) -> int:
        return int(self.header["tree"]["max_depth"])

    @property
    def max_size(self) -> int:
        return int(self.header["tree"]["max_size"])

    @property
    def max_new_tokens(self) -> int:
        return int(self.header["max_new_tokens"])

    @property
    def num_prompts(self) -> int:
        return len(self.arrays["prompt_offsets"]) - 1

    def num_candidates(self, depth: int) -> int:
        return num_candidates(self.width, depth)

    def prompt(self, i: int) -> list[int]:
        off = self.arrays["prompt_offsets"]
        return self.arrays["prompt_tokens"][off[i]: off[i + 1]].tolist()

    def continuation(self, i: int) -> np.ndarray:
        off = self.arrays["continuation_offsets"]
        return self.arrays["continuation"][off[i]: off[i + 1]]

    def positions(self, i: int) -> slice:
        off = self.arrays["position_offsets"]
        return slice(int(off[i]), int(off[i + 1]))

    def budget(self, i: int, max_new_tokens: int | None = None) -> tuple[int, bool]:
        """(tokens the generation of prompt i emits, ended by EOS?) under `max_new_tokens` (<= the trace's)."""
        max_new = self.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        if max_new > self.max_new_tokens:
            raise ValueError(f"max_new_tokens={max_new} exceeds the trace's {self.max_new_tokens}: record again "
                             "with a larger --max-new-tokens")
        eos_at = int(self.arrays["eos_at"][i])
        if 0 <= eos_at < max_new:
            return eos_at + 1, True
        return max_new, False

    def accepted(self, i: int, t: int, depth: int, size: int) -> int:
        """Accepted draft tokens when the cycle at position t of prompt i drafts `depth` levels and verifies the
        top `size` candidates (size is clipped like the decoder clips it)."""
        size = clip_size(size, self.num_candidates(depth), self.max_size)
        ranks = self.arrays["onpath_rank"][self.positions(i).start + t, depth - 1]
        return int(np.count_nonzero(ranks < size))

    # -- io ---------------------------------------------------------------------------------------------------------------
    def save(self, out_dir: str | Path) -> Path:
        """Write out_dir/trace.npz then trace.json, each atomically (a crash never leaves a half-written file)."""
        out_dir = Path(out_dir)
        with atomic_path(out_dir / ARRAYS_FILE) as tmp:
            np.savez_compressed(tmp, **self.arrays)
        atomic_write_text(out_dir / HEADER_FILE, json.dumps(self.header, indent=1))
        self.path = out_dir
        return out_dir

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        """The trace in a directory (or its trace.npz); FileNotFoundError / InputFileError name the file when it is
        missing, truncated, garbage or inconsistent with its header."""
        path = Path(path)
        out_dir = path if path.is_dir() else path.parent
        npz, header = out_dir / ARRAYS_FILE, out_dir / HEADER_FILE
        if not npz.is_file() or not header.is_file():
            raise FileNotFoundError(f"no trace at {path}: expected trace.npz and trace.json (write them with "
                                    "`specpilot record --out DIR`)")
        head = TraceHeader.load(out_dir).data  # read and checked: version, tree, budget
        try:
            with np.load(npz, allow_pickle=False) as data:
                arrays = {k: data[k] for k in data.files}
        except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile, zlib.error) as err:
            raise InputFileError(f"{npz} is not a readable trace ({type(err).__name__}: {err}): the file is "
                                 f"truncated or corrupted; {RECORD_AGAIN}") from None
        _check_trace(head, arrays, header, npz)
        return cls(head, arrays, out_dir)


ARRAYS = ("prompt_tokens", "prompt_offsets", "continuation", "continuation_offsets", "eos_at", "position_offsets",
          "scores", "top_prob", "entropy", "onpath_rank")


def _check_trace(head: dict, arrays: dict, header: Path, npz: Path) -> None:
    """The header's tree and budget are integers and the arrays have the shapes they promise (a trace.npz from
    another recording, or a cut-off write, fails here with the file named instead of deep inside replay)."""
    try:
        tree = head["tree"]
        width, max_depth, _ = (int(tree[k]) for k in ("width", "max_depth", "max_size"))
        int(head["max_new_tokens"])
    except (KeyError, TypeError, ValueError) as err:
        raise InputFileError(f"{header} lacks a valid tree {{width, max_depth, max_size}} / max_new_tokens entry "
                             f"({type(err).__name__}: {err}); {RECORD_AGAIN}") from None
    missing = [k for k in ARRAYS if k not in arrays]
    if missing:
        raise InputFileError(f"{npz} lacks the array(s) {', '.join(missing)}; {RECORD_AGAIN}")
    rows = int(arrays["scores"].shape[0]) if arrays["scores"].ndim == 2 else -1
    candidates = num_candidates(width, max_depth)
    offsets = arrays["position_offsets"]
    problems = []
    if arrays["scores"].ndim != 2 or arrays["scores"].shape[1] != candidates:
        problems.append(f"scores has shape {arrays['scores'].shape}, expected (N, {candidates}) for W={width}, "
                        f"D={max_depth}")
    if offsets.ndim != 1 or len(offsets) != len(arrays["prompt_offsets"]) or int(offsets[-1]) != rows:
        problems.append("position_offsets do not match the prompts and the scores rows")
    if arrays["onpath_rank"].shape != (rows, max_depth, max_depth):
        problems.append(f"onpath_rank has shape {arrays['onpath_rank'].shape}, expected ({rows}, {max_depth}, "
                        f"{max_depth})")
    if "positions" in head and int(head["positions"]) != rows:
        problems.append(f"{header.name} says {head['positions']} positions, the arrays hold {rows}")
    if problems:
        raise InputFileError(f"{npz} does not match {header.name}: {'; '.join(problems)}; {RECORD_AGAIN}")


# ---------------------------------------------------------------------------------------------------------------------
# recording


def greedy_continuation(pair, prompt: list[int], max_new_tokens: int, lookahead: int,
                        ar_timing: list | None = None) -> tuple[list[int], int]:
    """(target's greedy tokens, index of the first EOS or -1): up to max_new_tokens, then `lookahead` more tokens
    past the budget or past the first EOS (autoregressive_generate stops at EOS; it is called again to go on).
    ar_timing: when a list, the first call generates exactly max_new_tokens (the lookahead is a second call) and
    its (tokens, seconds incl. prefill) are appended: the live autoregressive timing of this prompt that
    `specpilot.envs.shards.measure_ar` would measure with one more generation."""
    from specpilot.drafting.decoder import autoregressive_generate

    eos = pair.eos_token_ids
    tokens: list[int] = []
    want = max_new_tokens + lookahead
    eos_at = -1
    timed = ar_timing is not None
    while len(tokens) < want:
        asked = max_new_tokens if timed else want - len(tokens)
        out = autoregressive_generate(pair, prompt + tokens, max_new_tokens=asked)
        if timed:
            ar_timing.append((out.num_tokens, out.total_s))
            timed = False
        tokens.extend(out.tokens)
        end = first_end(tokens[:max_new_tokens], eos)
        if eos_at < 0 and end is not None:
            eos_at = end
            want = min(want, eos_at + 1 + lookahead)
        # go on past EOS, and past the timed call's budget into the lookahead; stop when a call came up short
        if not out.tokens or (out.finished_by != "eos" and (len(tokens) >= want or out.num_tokens < asked)):
            break
    return tokens[:want], eos_at


def _features(pair, tokens: list[int]):
    """The drafter's target features of every position of `tokens` (one target forward), None for a draft LM."""
    from specpilot.drafting.drafters import target_features

    if getattr(pair, "eagle", None) is None:
        return None
    out = pair.target(input_ids=torch.tensor([tokens], device=pair.device), output_hidden_states=True)
    return target_features(pair, out.hidden_states)


def _feed_rows(features, drafter, tokens: list[int]):
    """Rows of `features` the drafter reads to feed these next committed tokens (see DecodingSession)."""
    if features is None:
        return None
    end = drafter.committed + len(tokens) - 1
    return features[end - drafter.entries(tokens): end]


def _record_prompt(pair, tree_config, prompt: list[int], max_new_tokens: int, ar_timing: list | None = None) -> dict:
    from specpilot.drafting.attention import decoding_mode
    from specpilot.drafting.drafters import make_drafter
    from specpilot.drafting.tree import TreeDrafter

    w, d_max = tree_config.width, tree_config.max_depth
    cont, eos_at = greedy_continuation(pair, prompt, max_new_tokens, d_max, ar_timing)
    n = eos_at + 1 if eos_at >= 0 else min(max_new_tokens, len(cont))
    cap = num_candidates(w, d_max)
    depth_of = np.concatenate([np.ones(w, dtype=np.int64)] +
                              [np.full(w * w, d, dtype=np.int64) for d in range(2, d_max + 1)])
    scores = np.zeros((n, cap), dtype=np.float32)
    top_prob = np.zeros((n, d_max), dtype=np.float32)
    entropy = np.zeros((n, d_max), dtype=np.float32)
    ranks = np.full((n, d_max, d_max), NO_RANK, dtype=np.int16)
    drafter = TreeDrafter(make_drafter(pair), w, d_max)
    cont_arr = np.asarray(cont, dtype=np.int64)
    with decoding_mode(pair.device):  # the attention kernels live decoding uses (drafting/attention.py)
        features = _features(pair, prompt + cont[: max(n - 1, 0)])
        drafter.prefill(prompt[:-1], _feed_rows(features, drafter, prompt[:-1]))
        feed = [prompt[-1]]
        for t in range(n):
            if not drafter.can_start(len(feed)):  # an EAGLE head with a one-token context: nothing to draft yet
                drafter.feed(feed, _feed_rows(features, drafter, feed))
                feed = [int(cont_arr[t])]
                continue
            tree = drafter.start_cycle(feed, features=_feed_rows(features, drafter, feed))
            top_prob[t, 0], entropy[t, 0] = drafter.last_top_prob, drafter.last_entropy
            for d in range(2, d_max + 1):
                drafter.extend()
                top_prob[t, d - 1], entropy[t, d - 1] = drafter.last_top_prob, drafter.last_entropy
            assert tree.size == cap, f"tree of {tree.size} candidates, expected {cap} (vocabulary smaller than W?)"
            scores[t] = tree.scores[:cap].cpu().numpy()
            tokens = tree.tokens[:cap].cpu().numpy()
            parents = tree.parents[:cap].cpu().numpy()
            ranked = tree.ranked().cpu().numpy()
            drafter.end_cycle()
            feed = [int(cont_arr[t])]
            # the on-path chain: node at depth k whose tokens from the root are cont[t : t+k]
            chain: list[int] = []
            parent = -1
            for k in range(1, d_max + 1):
                if t + k - 1 >= len(cont_arr):
                    break
                lo, hi = level_bounds(w, k)
                hit = np.nonzero((parents[lo:hi] == parent) & (tokens[lo:hi] == cont_arr[t + k - 1]))[0]
                if hit.size == 0:
                    break
                parent = lo + int(hit[0])
                chain.append(parent)
            if not chain:
                continue
            position = np.empty(cap, dtype=np.int64)
            position[ranked] = np.arange(cap)
            ranked_depth = depth_of[ranked]
            chain_pos = position[np.asarray(chain)]
            for d in range(1, d_max + 1):
                rank_d = np.cumsum(ranked_depth <= d) - 1  # rank among depth <= d at each ranked position
                k = min(d, len(chain))
                ranks[t, d - 1, :k] = rank_d[chain_pos[:k]]
    return {"continuation": cont, "eos_at": eos_at, "scores": scores, "top_prob": top_prob, "entropy": entropy,
            "onpath_rank": ranks}


def record_trace(pair, tree_config, prompts, *, max_new_tokens: int = 128, progress: bool = False,
                 prompt_texts: list | None = None, ar_timing: list | None = None) -> Trace:
    """Record a greedy trace of `prompts` (strings or token lists) on `pair` with `tree_config`. ar_timing: a list
    that receives each prompt's live autoregressive (tokens, seconds) (`greedy_continuation`)."""
    ids = [pair.encode(getattr(p, "prompt", p)) for p in prompts]
    if not ids:
        raise ValueError("no prompts to record")
    parts = []
    started = time.perf_counter()
    for i, prompt in enumerate(ids):
        parts.append(_record_prompt(pair, tree_config, prompt, max_new_tokens, ar_timing))
        if progress:
            print(f"  trace: prompt {i + 1}/{len(ids)} ({len(parts[-1]['scores'])} positions, "
                  f"{time.perf_counter() - started:.1f}s)", flush=True)

    def offsets(lengths):
        return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

    arrays = {
        "prompt_tokens": np.concatenate([np.asarray(p, dtype=np.int32) for p in ids]),
        "prompt_offsets": offsets([len(p) for p in ids]),
        "continuation": np.concatenate([np.asarray(x["continuation"], dtype=np.int32) for x in parts]),
        "continuation_offsets": offsets([len(x["continuation"]) for x in parts]),
        "eos_at": np.asarray([x["eos_at"] for x in parts], dtype=np.int32),
        "position_offsets": offsets([len(x["scores"]) for x in parts]),
        "scores": np.concatenate([x["scores"] for x in parts]),
        "top_prob": np.concatenate([x["top_prob"] for x in parts]),
        "entropy": np.concatenate([x["entropy"] for x in parts]),
        "onpath_rank": np.concatenate([x["onpath_rank"] for x in parts]),
    }
    texts = prompt_texts if prompt_texts is not None else [p if isinstance(p, str) else None for p in prompts]
    header = {
        "version": TRACE_VERSION,
        "pair": pair.identity(),
        "device": str(pair.device),
        "dtype": str(pair.dtype),
        "eos_token_id": pair.eos_token_id,
        "tree": {"width": tree_config.width, "max_depth": tree_config.max_depth, "max_size": tree_config.max_size},
        "max_new_tokens": int(max_new_tokens),
        "temperature": 0.0,
        "prompts": [{"text": t, "num_tokens": len(p)} for t, p in zip(texts, ids)],
        "positions": int(arrays["scores"].shape[0]),
        "recorded_s": time.perf_counter() - started,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    return Trace(header, arrays)


@holds_output("out_dir", what="trace folder (--out)")
def record_task(pair, tree_config, prompts, out_dir: str | Path, *, max_new_tokens: int = 128,
                profile_prompts: int | None = None, profile_cycles: int = 0, seed: int = 0, progress: bool = False,
                executor=None, ar: bool = False, shard_size: int | None = None,
                trace_workers=None, measure: bool = True) -> tuple[Path, Path]:
    """Write out_dir/trace.npz + trace.json and out_dir/profile.json (and ar.json when `ar`: the live
    autoregressive timing of the prompts); return (trace dir, profile path).

    Runs on `pair` in this process, or on `executor` (`specpilot.drafting.executor`: e.g. a Ray WorkerPool), in
    resumable shards (`specpilot.envs.shards`); out_dir/cluster.json says which worker recorded which shard. The
    latency profile is measured on the first `profile_prompts` prompts (default: all) with random (depth, size)
    per cycle (`specpilot.envs.profile.collect_samples`), each shard seeding its draws with (seed, shard), and
    decoding them again until the profile holds at least `profile_cycles` cycles (shared by the shards in
    proportion to their profile prompts).

    trace_workers: an executor of processes that share this machine's cores (`specpilot.train.scale.processes.
    ProcessPool`, one torch thread each): they record the traces' shards side by side, and the latency profile and
    the AR timing, which read clocks, are measured afterwards on `pair` / `executor` alone (OUT/shards/timing/; with
    `ar`, ar.json then times the AR generations of the profile prompts, one after each prompt's profile cycles).
    Recording reads no clock, so the trace is the same either way (its pair is checked to be the same).

    measure=False records the trace only (no profile.json, no ar.json; profile_prompts, profile_cycles and ar are
    then unused): for a split that takes the latency profile measured with another split (`record_traces`)."""
    out_dir = check_recording_writable(out_dir)  # before minutes of recording
    if not measure:
        profile_cycles, ar = 0, False
    executor = as_executor(pair, executor)
    apart = trace_workers is not None  # the clocks apart from the recording processes
    recorders = trace_workers if apart else executor
    items = [getattr(p, "prompt", p) for p in prompts]
    n_profile = 0 if not measure else len(items) if not profile_prompts else min(int(profile_prompts), len(items))
    tree = {"width": tree_config.width, "max_depth": tree_config.max_depth, "max_size": tree_config.max_size}
    worker = executor.workers[0]
    if apart:
        check_same_pair(worker, recorders.workers)

    def plan_of(ranges) -> tuple[str, dict, tuple[str]]:
        """(key, fields, older key) of the plan recording `ranges` (`specpilot.envs.shards.plan_key`)."""
        # the plan's models by content (hashes, dtype), never by the paths they were loaded from: the same pair
        # given relatively, absolutely or copied elsewhere resumes the shards already recorded
        parts = dict(prompts=items, tree=tree, max_new_tokens=max_new_tokens, profile_prompts=n_profile, seed=seed,
                     ar=ar, profile_cycles=int(profile_cycles), shards=[list(r) for r in ranges],
                     **sh.pair_content(worker["pair"], worker.get("dtype")), **({"timing": "apart"} if apart else {}),
                     **({} if measure else {"measure": False}))
        if apart or not measure:  # (shards without profile samples: never those of a recording that timed in them)
            return sh.plan_key(**parts), sh.plan_fields(**parts), ()
        legacy = sh.plan_key(prompts=items, tree=tree, max_new_tokens=max_new_tokens, profile=n_profile, seed=seed,
                             ar=ar, ranges=ranges, pair=worker["pair"],
                             **({"profile_cycles": int(profile_cycles)} if profile_cycles else {}))  # older done.json
        return sh.plan_key(**parts), sh.plan_fields(**parts), (legacy,)

    # apart: one prompt a shard, so no process idles while another records a last long shard (a shard costs a
    # small file; the timing is not per shard)
    ranges = _shard_layout(out_dir, len(items), len(recorders), shard_size or (1 if apart else None), plan_of)
    key, plan, legacy = plan_of(ranges)
    started = time.perf_counter()
    dirs = [out_dir / sh.SHARDS_DIR / f"shard-{i:04d}" for i in range(len(ranges))]
    finished = [i for i, d in enumerate(dirs) if sh.read_done(d, key, plan=plan, also=legacy) is not None]
    damaged = {i: why for i in finished
               if (why := _unreadable_shard(dirs[i], samples=ranges[i][0] < n_profile and not apart,
                                            ar=ar and not apart)) is not None}
    for i, why in damaged.items():  # found before recording the rest, not at the merge: resuming records it again
        (dirs[i] / sh.DONE_FILE).unlink()
        print(f"  shard {dirs[i]} is damaged ({why}): recording it again", file=sys.stderr, flush=True)
    finished = [i for i in finished if i not in damaged]
    check_recording_writable(out_dir, [d for i, d in enumerate(dirs) if i not in finished])
    tasks = [ShardTask(i, {"prompts": items[lo:hi], "tree": tree, "max_new_tokens": max_new_tokens,
                           "profile_prompts": [] if apart else items[lo:min(hi, n_profile)], "seed": [seed, i],
                           "ar": ar and not apart, "progress": progress,
                           "profile_cycles": 0 if apart else share_of(profile_cycles,
                                                                      max(0, min(hi, n_profile) - lo), n_profile)},
                       list(range(lo, hi)))
             for i, (lo, hi) in enumerate(ranges) if i not in finished]
    say = (lambda msg: print(f"  {msg}", flush=True)) if progress else None
    if say and finished:
        say(f"resuming: {len(finished)} of {len(ranges)} shards already recorded under {out_dir / sh.SHARDS_DIR}")
    recorders.map(record_shard, tasks, progress=say,
                  on_done=lambda task, outcome: write_shard(dirs[task.shard], outcome, key, ranges[task.shard],
                                                             plan=plan))
    timing = None
    if apart and measure:  # every recording process is idle now: the clocks are read by one process alone
        timing = out_dir / sh.SHARDS_DIR / TIMING_DIR
        done = sh.read_done(timing, key, plan=plan)
        if done is not None and (why := _unreadable_shard(timing, samples=True, ar=ar, trace=False)) is not None:
            (timing / sh.DONE_FILE).unlink()
            print(f"  {timing} is damaged ({why}): measuring it again", file=sys.stderr, flush=True)
            done = None
        if done is None:
            task = ShardTask(len(ranges), {"profile_prompts": items[:n_profile], "tree": tree,
                                           "max_new_tokens": max_new_tokens, "seed": [seed, len(ranges)], "ar": ar,
                                           "profile_cycles": int(profile_cycles), "recorders": len(recorders)},
                             list(range(n_profile)))
            t0 = time.perf_counter()
            [outcome] = executor.map(time_shard, [task], progress=say)
            write_shard(timing, outcome, key, (0, n_profile), plan=plan)
            if say:
                say(f"latency profile{' and AR timing' if ar else ''} on {n_profile} prompt(s), measured alone after "
                    f"the traces ({time.perf_counter() - t0:.1f}s)")
    summary = merge_shards(out_dir, dirs, ranges, key, resumed=finished, ar=ar, seed=seed, plan=plan, also=legacy,
                           timing=timing)
    summary.update(workers=recorders.workers, wall_s=time.perf_counter() - started,
                   **({"timing_worker": worker} if apart else {}))
    atomic_write_text(out_dir / sh.CLUSTER_FILE, json.dumps(summary, indent=1, default=str))
    if say and summary["retried_prompts"]:
        say(f"retried prompts (their shard failed once): {summary['retried_prompts']}")
    return out_dir, profile_path(out_dir)


# worker counts whose default shard layouts a resumed recording tries (`_shard_layout`)
RESUMABLE_WORKER_COUNTS = range(1, 257)


def _shard_layout(out_dir: Path, n: int, workers: int, shard_size: int | None, plan_of) -> list[tuple[int, int]]:
    """The prompt ranges of the recording's shards: those of the recording already under out_dir/shards when its
    finished shards match one (the default layout depends on the worker count at its start, so a recording begun
    with --ray and --workers 2 resumes without Ray or with other --workers), else the default for `workers`."""
    recorded = sh.recorded_keys(out_dir / sh.SHARDS_DIR)
    default = shard_ranges(n, workers, shard_size)
    if not recorded or shard_size:
        return default
    layouts = [default, *(shard_ranges(n, w) for w in RESUMABLE_WORKER_COUNTS)]
    for ranges in dict.fromkeys(tuple(r) for r in layouts):
        key, _, legacy = plan_of(list(ranges))
        if recorded & {key, *legacy}:
            return list(ranges)
    return default


def check_recording_writable(out_dir: str | Path, shard_dirs: Sequence[Path] = ()) -> Path:
    """out_dir as a Path when a recording can write there: the folder, its shards/ folder and the existing shard
    folders about to be (re)recorded; else OutputPathError naming the folder (a read-only shards/ failed with a raw
    "[Errno 1]" only after the first shard was recorded)."""
    out_dir = check_writable(out_dir, kind="dir", what="trace folder (--out)")
    check_writable(out_dir / sh.SHARDS_DIR, kind="dir", what="its shards folder")
    for shard in shard_dirs:
        if shard.exists():
            check_writable(shard, kind="dir", what="shard folder (delete it to record it again)")
    return out_dir


# ---------------------------------------------------------------------------------------------------------------------
# shards of a recording (`record_task` on an executor)


def record_shard(worker, *, prompts: list, tree: dict, max_new_tokens: int, profile_prompts: list, seed: list[int],
                 ar: bool, profile_cycles: int = 0, progress: bool = False) -> dict:
    """The work unit: the trace of `prompts`, profile samples of `profile_prompts` and (ar) the live AR timing."""
    from specpilot.drafting.types import TreeConfig
    from specpilot.envs.profile import collect_samples, collect_samples_with_ar

    tree_config = TreeConfig(**tree)
    # the live AR timing is taken from the recording's own greedy generations (they are plain AR generations of
    # these prompts), not from a second pass over them: one AR generation less per prompt (~25% of recording)
    timing = None
    if ar:
        timing = []
        if worker.first("ar"):  # warm-up, not timed (as measure_ar's)
            from specpilot.drafting.decoder import autoregressive_generate
            autoregressive_generate(worker.pair, prompts[0], max_new_tokens=max_new_tokens)
    trace = record_trace(worker.pair, tree_config, prompts, max_new_tokens=max_new_tokens, progress=progress,
                         ar_timing=timing)
    out = {"header": trace.header, "arrays": trace.arrays, "samples": None, "ar": None}
    if profile_prompts:
        # with ar, each profile prompt is followed by a timed AR generation: the reference replay speedups divide
        # by (profile meta "ar_seconds_per_token") is then measured beside the profile, not minutes earlier
        kw = dict(max_new_tokens=max_new_tokens, rng=np.random.default_rng(seed), min_cycles=profile_cycles,
                  warmup_cycles=16 if worker.first("profile") else 0)
        samples = (collect_samples_with_ar(worker.pair, tree_config, profile_prompts, ar_warmup=False, **kw) if ar
                   else collect_samples(worker.pair, tree_config, profile_prompts, **kw))
        out["samples"] = sh.samples_to_dict(samples)
    if ar:
        out["ar"] = sh.ar_summary(timing, prompts=len(prompts), max_new_tokens=max_new_tokens,
                                  source="the recording's greedy generations (max_new_tokens each, prefill included)")
    return out


def time_shard(worker, *, profile_prompts: list, tree: dict, max_new_tokens: int, seed: list[int], ar: bool,
               profile_cycles: int = 0, recorders: int = 1) -> dict:
    """The work unit of the timing measured apart from the recording processes (`record_task(trace_workers=...)`):
    profile samples of `profile_prompts`, with `ar` each prompt followed by a timed AR generation
    (`collect_samples_with_ar`), whose timing is the recording's ar.json."""
    from specpilot.drafting.types import TreeConfig
    from specpilot.envs.profile import collect_samples, collect_samples_with_ar

    kw = dict(max_new_tokens=max_new_tokens, rng=np.random.default_rng(seed), min_cycles=profile_cycles,
              warmup_cycles=16 if worker.first("profile") else 0)
    tree_config = TreeConfig(**tree)
    if not ar:
        samples = collect_samples(worker.pair, tree_config, profile_prompts, **kw)
        return {"header": None, "arrays": None, "samples": sh.samples_to_dict(samples), "ar": None}
    samples = collect_samples_with_ar(worker.pair, tree_config, profile_prompts, ar_warmup=worker.first("ar"), **kw)
    timing = [(int(samples.meta["ar_tokens"]), float(samples.meta["ar_s"]))]
    source = (f"AR generations of the {len(profile_prompts)} profile prompts (max_new_tokens each, prefill included), "
              f"each timed after its prompt's profile cycles, alone: the trace was recorded on {recorders} processes "
              "side by side, whose clocks were not used")
    return {"header": None, "arrays": None, "samples": sh.samples_to_dict(samples),
            "ar": sh.ar_summary(timing, prompts=len(profile_prompts), max_new_tokens=max_new_tokens, source=source)}


def check_same_pair(timer: dict, recorders: Sequence[dict]) -> None:
    """Refuse recording processes whose pair (weights by hash, dtype) is not the timing process's: the trace and the
    profile of one recording describe one pair."""
    want = sh.pair_content(timer["pair"], timer.get("dtype"))
    for other in recorders:
        if sh.pair_content(other["pair"], other.get("dtype")) != want:
            raise ValueError(f"trace worker {other.get('worker')} holds another pair than the process that times the "
                             f"recording ({other['pair']} in {other.get('dtype')} vs {timer['pair']} in "
                             f"{timer.get('dtype')}): start the trace workers with the same models and dtype")


def merge_traces(traces: Sequence[Trace]) -> Trace:
    """One Trace from shard traces in prompt order: per-prompt arrays concatenated, `*_offsets` re-based."""
    if not traces:
        raise ValueError("no shard traces to merge")
    first = traces[0].header
    for t in traces[1:]:
        for key in ("version", "tree", "max_new_tokens", "eos_token_id", "temperature", "dtype"):
            if t.header.get(key) != first.get(key):
                raise ValueError(f"shard traces differ in {key!r} ({first.get(key)} vs {t.header.get(key)})")
        if not same_pair(t.header["pair"], first["pair"]):  # by weight hashes: hosts' folders may differ
            raise ValueError(f"shard traces come from different pairs ({first['pair']} vs {t.header['pair']})")
    arrays: dict[str, np.ndarray] = {}
    for key in traces[0].arrays:
        parts = [t.arrays[key] for t in traces]
        if key.endswith("_offsets"):
            lengths = np.concatenate([np.diff(p) for p in parts])
            arrays[key] = np.concatenate([[0], np.cumsum(lengths)]).astype(parts[0].dtype)
        else:
            arrays[key] = np.concatenate(parts)
    header = dict(first)
    header["prompts"] = [p for t in traces for p in t.header["prompts"]]
    header["positions"] = int(arrays["scores"].shape[0])
    header["recorded_s"] = float(sum(t.header.get("recorded_s", 0.0) for t in traces))
    header["sharded"] = {"shards": len(traces), "devices": sorted({str(t.header.get("device")) for t in traces})}
    return Trace(header, arrays)


def _unreadable_shard(shard_dir: Path, *, samples: bool, ar: bool, trace: bool = True) -> str | None:
    """Why a finished shard's files cannot be merged (a truncated trace.npz, a garbage samples.json, a missing
    ar.json), None when they can: the same reads the merge makes, so resume finds it before recording the rest."""
    try:
        if trace:
            Trace.load(shard_dir)
        if samples:
            sh.samples_from_dict(read_json(shard_dir / "samples.json", what="profile samples of a shard", fix=""))
        if ar:
            read_json(shard_dir / sh.AR_FILE, what="AR timing of a shard", fix="")
    except (OSError, ValueError, KeyError, TypeError) as err:  # (InputFileError is a ValueError)
        return str(err).replace(f"; {RECORD_AGAIN}", "").rstrip("; ")
    return None


def write_shard(shard_dir: Path, outcome, key: str, prompts: tuple[int, int], *, plan: dict | None = None) -> None:
    shard_dir.mkdir(parents=True, exist_ok=True)
    res = outcome.result
    if res["header"] is not None:  # (the timing measured apart has no trace)
        Trace(res["header"], res["arrays"]).save(shard_dir)
    if res["samples"] is not None:
        atomic_write_json(shard_dir / "samples.json", res["samples"], indent=None)
    if res["ar"] is not None:
        atomic_write_json(shard_dir / sh.AR_FILE, res["ar"])
    done = {"key": key, "prompts": list(range(*prompts)), "worker": outcome.worker, "attempts": outcome.attempts,
            "retried": outcome.retried, **({"plan": plan} if plan is not None else {})}
    atomic_write_json(shard_dir / sh.DONE_FILE, done)  # last: its presence means the shard is complete


def merge_shards(out_dir: Path, dirs: list[Path], ranges, key: str, *, resumed: list[int], ar: bool,
                 seed: int, plan: dict | None = None, also: Sequence[str] = (), timing: Path | None = None) -> dict:
    """Merge the shard folders into out_dir's trace, profile (and ar.json); describe the shards. `timing`: the
    folder of the profile samples (and AR timing) measured apart from the shards, which then hold traces only."""
    traces = [Trace.load(d) for d in dirs]
    trace = merge_traces(traces)
    trace.save(out_dir)
    shards, samples, ar_parts, retried = [], [], [], []
    fix = "delete the shard folder to record it again"
    for i, d in enumerate(dirs):
        done = sh.read_done(d, key, plan=plan, also=also)
        device = traces[i].header.get("device")
        if (d / "samples.json").is_file():
            data = read_json(d / "samples.json", what="profile samples of a shard", fix=fix)
            samples.append((str(device), sh.samples_from_dict(data)))
        if ar and timing is None:
            ar_parts.append(read_json(d / sh.AR_FILE, what="AR timing of a shard", fix=fix))
        if done.get("retried"):
            retried.extend(range(*ranges[i]))
        shards.append({"shard": i, "prompts": list(range(*ranges[i])), "device": device,
                       "worker": (done.get("worker") or {}).get("worker"), "attempts": done.get("attempts"),
                       "retried": done.get("retried"), "resumed": i in resumed})
    if timing is not None:
        fix = "delete the folder to measure it again"
        done = sh.read_done(timing, key, plan=plan)
        data = read_json(timing / "samples.json", what="profile samples measured apart", fix=fix)
        samples.append((str((done.get("worker") or {}).get("device")), sh.samples_from_dict(data)))
        if ar:
            ar_parts.append(read_json(timing / sh.AR_FILE, what="AR timing measured apart", fix=fix))
    if samples:
        pooled = sh.merge_samples(samples)
        pooled.meta["seed"] = seed
        profile = pooled.profile()
        profile.meta["pair"] = trace.header["pair"]
        profile.save(profile_path(out_dir))
    if ar:
        atomic_write_json(out_dir / sh.AR_FILE, sh.merge_ar(ar_parts))
    return {"out": str(out_dir), "shards": shards, "retried_prompts": retried, "resumed_shards": resumed,
            "positions": trace.header["positions"]}
