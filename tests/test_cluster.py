"""The orchestrators on a local Ray with two CPU workers and a tiny saved pair: recording equals a single-process
recording, an interrupted run resumes, a dead or failing worker's shard is retried and reported, evaluation keeps
the report structure with each worker's device, and the grid's live phase runs on the pool."""
from __future__ import annotations

import json

import pytest

from specpilot.drafting.pair import ModelPair
from specpilot.drafting.types import TreeConfig
from specpilot.envs.profile import LatencyProfile
from specpilot.envs.record import Trace, record_task, record_trace
from specpilot.eval.report import write_report
from specpilot.eval.runner import evaluate
from specpilot.eval.suites import Prompt
from specpilot.drafting.errors import InputFileError
from specpilot.envs.shards import CLUSTER_FILE
from specpilot.train.grid.search import grid_search
from sharded import PROMPTS, TREE, assert_same_tables



@pytest.fixture(scope="module")
def local_pair(saved_pair):
    return ModelPair.from_pretrained(str(saved_pair / "target"), str(saved_pair / "draft"), device="cpu")


@pytest.fixture(scope="module")
def sharded(ray_pool, tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    record_task(None, TREE, PROMPTS, out, max_new_tokens=12, profile_prompts=4, ar=True, executor=ray_pool)
    return out, json.loads((out / CLUSTER_FILE).read_text())


@pytest.mark.heavy
def test_sharded_record_writes_what_a_single_process_record_writes(sharded, local_pair, tmp_path):
    out, summary = sharded
    record_task(local_pair, TREE, PROMPTS, tmp_path, max_new_tokens=12, profile_prompts=4)
    got, want = Trace.load(out), Trace.load(tmp_path)
    assert_same_tables(got, want)
    for key in ("pair", "tree", "prompts", "positions", "max_new_tokens", "eos_token_id", "device"):
        assert got.header[key] == want.header[key], key
    profile = LatencyProfile.load(out / "profile.json")
    assert profile.meta["pair"] == want.header["pair"] and profile.meta["devices"] == ["cpu"]
    assert len(profile.meta["sample_device"]["verify"]) == profile.meta["cycles"] > 0
    assert set(LatencyProfile.load(tmp_path / "profile.json").to_dict()) == set(profile.to_dict())
    assert json.loads((out / "ar.json").read_text())["tokens"] > 0
    shards = json.loads((out / CLUSTER_FILE).read_text())["shards"]
    assert [p for s in shards for p in s["prompts"]] == list(range(len(PROMPTS)))
    assert summary["retried_prompts"] == [] and summary["resumed_shards"] == []


def test_a_rerun_resumes_from_the_shards_already_written(sharded, ray_pool):
    out, summary = sharded
    before = Trace.load(out)
    (out / "shards" / "shard-0002" / "done.json").unlink()  # as if the run died while shard 2 was recorded
    record_task(None, TREE, PROMPTS, out, max_new_tokens=12, profile_prompts=4, ar=True, executor=ray_pool)
    again = json.loads((out / CLUSTER_FILE).read_text())
    assert again["resumed_shards"] == [i for i in range(len(summary["shards"])) if i != 2]
    assert_same_tables(Trace.load(out), before)


def test_shards_of_another_recording_are_refused(sharded, ray_pool):
    out, _ = sharded
    with pytest.raises(InputFileError, match="another recording"):
        record_task(None, TREE, PROMPTS, out, max_new_tokens=8, executor=ray_pool)


EVAL_PROMPTS = [Prompt("c1", "code", "python", "heldout", "def add(a, b):"),
                Prompt("c2", "code", "python", "heldout", "def f(x):\n    return"),
                Prompt("q1", "qa", "it", "heldout", "Domanda: perché?"),
                Prompt("q2", "qa", "it", "heldout", "Risposta: sì")]
EVAL_KW = dict(methods=["fixed"], temperatures=(0.0,), max_new_tokens=8, warmup=1,
               tree=TreeConfig(width=2, max_depth=4, max_size=8))


def test_sharded_eval_keeps_the_report_structure_and_records_each_workers_device(ray_pool, local_pair, tmp_path):
    got = evaluate(EVAL_PROMPTS, executor=ray_pool, **EVAL_KW)
    want = evaluate(EVAL_PROMPTS, pair=local_pair, **EVAL_KW)

    def key(row):
        return row["task"], row["language"], row["method"], row["temperature"], row["concurrency"]

    assert sorted(map(key, got.results)) == sorted(map(key, want.results))
    assert len({key(r) for r in got.results}) == len(got.results)  # one worker per (task, language) row
    ref = {key(r): r for r in want.results}
    for row in got.results:
        assert set(row) == set(ref[key(row)])
        assert row["device"] == "cpu" and row["identical_to_ar"] is True
    assert {r["worker"] for r in got.results} == {0, 1}  # two groups, two workers
    assert [w["device"] for w in got.meta["workers"]] == ["cpu", "cpu"]
    assert got.meta["prompt_mix"] == want.meta["prompt_mix"] and got.meta["executor"]["retried_prompts"] == []
    tokens = {(r.prompt_id, r.method): r.tokens for r in want.records}
    assert {(r.prompt_id, r.method): r.tokens for r in got.records} == tokens
    report = json.loads(open(write_report(got.results, got.meta, tmp_path, plots=False)["json"]).read())
    assert {r["worker"] for r in report["results"]} == {0, 1}


def test_sharded_eval_applies_the_stop_strings_on_every_worker(ray_pool, local_pair):
    from specpilot.drafting import autoregressive_generate

    first, last = (list(autoregressive_generate(local_pair, p.prompt, max_new_tokens=16).tokens)
                   for p in (EVAL_PROMPTS[0], EVAL_PROMPTS[-1]))
    text = local_pair.decode(first, skip_special_tokens=True)
    kw = {**EVAL_KW, "max_new_tokens": 16, "methods": ["fixed", "hf_generate"],
          "stop_strings": [text[len(text) // 2:][:2]], "stop_token_ids": [last[8]]}
    got = evaluate(EVAL_PROMPTS, executor=ray_pool, **kw)
    want = evaluate(EVAL_PROMPTS, pair=local_pair, **kw)
    tokens = {(r.prompt_id, r.method): r.tokens for r in want.records}
    assert {(r.prompt_id, r.method): r.tokens for r in got.records} == tokens
    assert any(len(t) < 16 for t in tokens.values())  # the options ended some generations early
    assert got.meta["sampling"] == want.meta["sampling"]
    assert {r["worker"] for r in got.results} == {0, 1}
    # an id outside the vocabulary is refused on the driver, not retried as a failing shard
    with pytest.raises(ValueError, match="stop token id must be"):
        evaluate(EVAL_PROMPTS, executor=ray_pool, **{**kw, "stop_token_ids": [local_pair.vocab_size]})


def test_sharded_grid_replays_exactly_and_remeasures_the_top_cells_on_every_worker(ray_pool, sharded, tmp_path):
    out, _ = sharded
    got = grid_search(out, executor=ray_pool, val_prompts=PROMPTS[:2], live_top=2, live_max_new_tokens=6,
                      out=tmp_path / "grid.json", heatmap=False)
    want = grid_search(out, live_top=0, heatmap=False)
    assert [(r["width"], r["depth"], r["size"], r["tokens"]) for r in got["table"]] == \
        [(r["width"], r["depth"], r["size"], r["tokens"]) for r in want["table"]]
    assert got["oracle"].keys() == want["oracle"].keys()
    assert got["best"]["source"] == "live" and len(got["live"]) == 2
    assert [w["worker"] for w in got["meta"]["workers"]] == [0, 1]
    assert all(row["speedup"] > 0 for row in got["live"])
    assert json.loads((tmp_path / "grid.json").read_text())["best"] == got["best"]


def test_demo_record_and_grid_stages_run_on_the_pool(ray_pool, local_pair, tmp_path):
    from specpilot.demo import STAGE_FUNCTIONS, DemoBudget

    budget = DemoBudget(max_new_tokens=6, width=2, max_depth=3, max_size=6, live_top=1)
    prompts = [Prompt(f"t{i}", "code", "python", "train", text) for i, text in enumerate(PROMPTS[:3])]
    common = dict(run_dir=tmp_path, pair=None, tree=TREE, budget=budget, seed=0, train=prompts, val=prompts[:2],
                  heldout=[], wandb=None, executor=ray_pool)
    STAGE_FUNCTIONS["record"](**common)
    for split in ("train", "validation"):  # what record_traces writes
        for name in ("trace.npz", "trace.json", "profile.json", "ar.json"):
            assert (tmp_path / "traces" / split / name).is_file(), (split, name)
    grid = STAGE_FUNCTIONS["grid"](**{**common, "pair": local_pair})  # the cost-model check runs here
    assert grid["best"]["source"] == "live" and (tmp_path / "grid.json").is_file()
    assert grid["cost_check"] and (tmp_path / "profile_check.json").is_file()


@pytest.mark.parametrize("mode, verb", [("exit", "died"), ("raise", "raised")])
def test_a_failed_shard_is_retried_and_its_prompts_reported(ray_pool, local_pair, tmp_path, mode, verb):
    ray_pool.inject_fault = {"shard": 1, "mode": mode}  # "exit" kills the worker process; Ray restarts it
    try:
        record_task(None, TREE, PROMPTS[:4], tmp_path, max_new_tokens=8, profile_prompts=1, executor=ray_pool)
        summary = json.loads((tmp_path / CLUSTER_FILE).read_text())
    finally:
        ray_pool.inject_fault = None
    assert summary["retried_prompts"] == [1]
    shard = summary["shards"][1]
    assert shard["attempts"] == 2 and f"{verb}" in shard["retried"]
    assert_same_tables(Trace.load(tmp_path), record_trace(local_pair, TREE, PROMPTS[:4], max_new_tokens=8))
    record_task(None, TREE, PROMPTS[:4], tmp_path / "after", max_new_tokens=8, profile_prompts=1, executor=ray_pool)
    assert json.loads((tmp_path / "after" / CLUSTER_FILE).read_text())["retried_prompts"] == []  # the pool still has working workers


@pytest.mark.parametrize("where", ["local", "ray"])
def test_prompt_lengths_are_counted_by_a_worker_so_ray_refuses_what_local_refuses(where, ray_pool, local_pair):
    from specpilot.drafting.checks import check_prompt_lengths
    from specpilot.drafting.executor import LocalExecutor, prompt_lengths

    executor = ray_pool if where == "ray" else LocalExecutor(local_pair)
    long = "x = f(1)\n" * (local_pair.max_context // 2)
    lengths, context = prompt_lengths(executor, [PROMPTS[0], long, PROMPTS[0]])
    assert context == local_pair.max_context
    assert lengths == {text: len(local_pair.encode(text)) for text in (PROMPTS[0], long)}
    prompts = [Prompt("short", "code", "python", "heldout", PROMPTS[0]),
               Prompt("long", "code", "python", "heldout", long)]
    with pytest.raises(ValueError, match="prompt 'long' is"):
        check_prompt_lengths(prompts, lengths, context=context, max_new_tokens=6, max_depth=3, truncate=False)


@pytest.mark.heavy
def test_cli_record_with_ray_local_writes_the_merged_files(saved_pair, tmp_path):
    """`specpilot record --ray local --workers 2` in a fresh process (its own local Ray)."""
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'specpilot[ray]'")
    import os
    import subprocess
    import sys

    suite = tmp_path / "prompts.txt"
    suite.write_text("\n".join(PROMPTS[1:4]) + "\n")  # one prompt per line
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "specpilot.cli", "record", "--suite", str(suite), "--out", str(out),
           "--target", str(saved_pair / "target"), "--draft", str(saved_pair / "draft"), "--device", "cpu",
           "--max-new-tokens", "6", "--width", "2", "--max-depth", "3", "--max-size", "6",
           "--ray", "local", "--workers", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("trace.npz", "trace.json", "profile.json", CLUSTER_FILE):
        assert (out / name).is_file(), name
    assert "2 workers" in proc.stderr and Trace.load(out).num_prompts == 3


@pytest.mark.heavy
def test_cli_eval_with_ray_local_keeps_every_option(saved_pair, tmp_path):
    """`specpilot eval --ray local --workers 2` runs the same evaluation as without Ray: --rounds 3 runs 3 rounds,
    --replay-dir adds replay and the cost-model check, --decide sets the deciding pair of the verdicts."""
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'specpilot[ray]'")
    import os
    import subprocess
    import sys

    suite = tmp_path / "prompts.txt"
    suite.write_text("\n".join(PROMPTS[:2]) + "\n")
    cmd = [sys.executable, "-m", "specpilot.cli", "eval", "--suite", str(suite), "--out", str(tmp_path / "eval"),
           "--target", str(saved_pair / "target"), "--draft", str(saved_pair / "draft"), "--device", "cpu",
           "--methods", "fixed", "--temperatures", "0", "--rounds", "3", "--decide", "fixed,ar",
           "--max-new-tokens", "6", "--width", "2", "--max-depth", "3", "--max-size", "6", "--no-plots",
           "--replay-dir", str(tmp_path / "replay"), "--ray", "local", "--workers", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["meta"]["rounds"]["by_temperature"]["0"]["rounds"] == 3
    assert report["replay"] and report["cost_check"] and (tmp_path / "replay" / "trace.npz").is_file()
    assert [(c["method"], c["baseline"]) for c in report["comparisons"]] == [("fixed", "ar")]
    assert report["comparisons"][0]["verdict"] and "2 workers" in proc.stderr


def test_an_unreachable_address_is_one_clear_error_before_ray_starts():
    """Nothing listens there: refused by a socket probe, not after Ray's ~20 s of client retries and log lines."""
    import socket

    from specpilot.train.scale.cluster import ClusterError, _check_reachable  # what connect() runs first

    with socket.socket() as probe:  # a port that was free a moment ago, with nothing listening on it now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ClusterError, match="cannot reach a Ray cluster"):
        _check_reachable(f"127.0.0.1:{port}")
    with pytest.raises(ClusterError, match="is not an address"):
        _check_reachable("no-port-here")


@pytest.mark.parametrize("server", ["http", "silent"])
def test_a_listening_server_that_is_not_ray_is_refused_before_ray_starts(server):
    """Something listens but does not speak gRPC (an HTTP/1 server, or one that never answers): one clear error in
    seconds; ray.init would retry such an address for about 15 minutes, printing Ray's client errors."""
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from specpilot.train.scale.cluster import ClusterError, _check_reachable

    if server == "http":
        srv = HTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        port, stop = srv.server_address[1], srv.shutdown
    else:
        srv = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel's backlog) and never writes
        port, stop = srv.getsockname()[1], srv.close
    try:
        with pytest.raises(ClusterError, match="not a Ray cluster"):
            _check_reachable(f"127.0.0.1:{port}", timeout_s=0.5)
    finally:
        stop()


def test_the_gcs_of_a_running_ray_passes_the_address_check(ray_pool):
    import ray

    from specpilot.train.scale.cluster import _check_reachable

    _check_reachable(ray.get_runtime_context().gcs_address)  # Ray's GCS answers the HTTP/2 preface as gRPC does


@pytest.mark.parametrize("preset", [False, True])
def test_worker_lines_reach_a_log_file_each_as_printed_and_without_colour_codes(preset):
    """Output to a file: no ANSI codes, no "[repeated 2x across cluster]" folding of the workers' progress lines;
    what the user's environment sets wins."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_DEDUP_LOGS", "RAY_COLOR_PREFIX")}
    if preset:
        env.update(RAY_DEDUP_LOGS="1", RAY_COLOR_PREFIX="1")
    code = ("import os; from specpilot.train.scale.cluster import import_ray; import_ray(); "
            "print(os.environ['RAY_DEDUP_LOGS'], os.environ['RAY_COLOR_PREFIX'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == (["1", "1"] if preset else ["0", "0"])


@pytest.fixture
def ctrl_c_interrupts():
    """SIGINT raising KeyboardInterrupt, as in a terminal, whatever this test run inherited (a shell starts
    background jobs with SIGINT ignored); restored after."""
    import signal

    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, inherited)


def test_ctrl_c_while_ray_starts_is_held_until_it_has_started_then_cleans_up(ctrl_c_interrupts):
    """One Ctrl-C inside `interrupts_held` waits for the block (a half-started Ray orphans its agents), runs the
    clean-up, then raises KeyboardInterrupt; a second Ctrl-C interrupts at once; the handler is restored."""
    import os
    import signal

    from specpilot.train.scale.cluster import interrupts_held

    before, done = signal.getsignal(signal.SIGINT), []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held("the test block has run", then=lambda: done.append("cleaned")):
            os.kill(os.getpid(), signal.SIGINT)
            done.append("block finished")
    assert done == ["block finished", "cleaned"] and signal.getsignal(signal.SIGINT) is before
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held("never", then=lambda: done.append("not run")):
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            done.append("not reached")
    assert done == ["block finished", "cleaned"] and signal.getsignal(signal.SIGINT) is before
    with pytest.raises(KeyboardInterrupt) as info:  # Ctrl-C held, then the block fails (ray.init cannot connect)
        with interrupts_held("never", then=lambda: done.append("cleaned again")):
            os.kill(os.getpid(), signal.SIGINT)
            raise ConnectionError("no cluster")
    assert isinstance(info.value.__cause__, ConnectionError) and done[-1] == "cleaned again"
    with pytest.raises(ConnectionError):  # no Ctrl-C: the block's own error, and no clean-up
        with interrupts_held("never", then=lambda: done.append("not run")):
            raise ConnectionError("no cluster")
    assert done[-1] == "cleaned again" and signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize("token, mode, expected", [
    ("file", None, "token"),        # `ray start`'s token on this node: sent, as Ray sends it to join `auto`
    ("env", None, "token"),
    (None, None, None),             # no token anywhere: Ray's own default
    ("file", "disabled", "disabled"),  # the user's choice stands
])
def test_a_found_auth_token_is_used_to_join_a_cluster_by_address(tmp_path, monkeypatch, token, mode, expected):
    import os
    import sys

    from specpilot.train.scale.cluster import use_found_token

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    env["HOME"] = str(tmp_path)
    monkeypatch.setattr(os, "environ", env)  # this process's Ray (other tests') keeps its own variables
    if mode is not None:
        env["RAY_AUTH_MODE"] = mode
    if token == "file":
        (tmp_path / ".ray").mkdir()
        (tmp_path / ".ray" / "auth_token").write_text("x" * 64)
    elif token == "env":
        env["RAY_AUTH_TOKEN"] = "x" * 64
    monkeypatch.delitem(sys.modules, "ray", raising=False)  # as before Ray is imported (the only time it is read)
    use_found_token()
    assert env.get("RAY_AUTH_MODE") == expected


def test_a_process_that_ignores_ctrl_c_keeps_ignoring_it_while_ray_starts(ctrl_c_interrupts):
    import os
    import signal

    from specpilot.train.scale.cluster import interrupts_held

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # started in the background by a shell
    with interrupts_held("never", then=lambda: pytest.fail("nothing to clean up")):
        os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_with_ray_use_tls_only_the_connection_is_checked(monkeypatch):
    """A TLS cluster answers only a TLS handshake, never the plain-text gRPC probe: with RAY_USE_TLS the probe is
    skipped (nothing listening is still refused)."""
    import socket

    from specpilot.train.scale.cluster import ClusterError, _check_reachable

    monkeypatch.setenv("RAY_USE_TLS", "1")
    with socket.create_server(("127.0.0.1", 0)) as silent:
        _check_reachable(f"127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.5)
        port = silent.getsockname()[1]
    with pytest.raises(ClusterError, match="cannot reach a Ray cluster"):
        _check_reachable(f"127.0.0.1:{port}", timeout_s=0.5)


def test_a_worker_answers_whether_transformers_can_assist_with_its_pair(ray_pool):
    from specpilot.eval.methods import assisted_refusal_on

    assert assisted_refusal_on(ray_pool) is None   # same output sizes: hf_assisted may run


def test_sigterm_while_ray_starts_is_held_and_the_clis_handler_survives_ray_init(ctrl_c_interrupts):
    """ray.init installs its own SIGTERM handler (sys.exit(15): no checkpoint, no message): the CLI's is put back
    after the block, and a SIGTERM held during it interrupts through the CLI's handler once the block is done."""
    import os
    import signal

    from specpilot.train.scale.cluster import interrupts_held

    seen = []

    def cli_handler(signum, frame):  # the CLI's: note the signal, then interrupt
        seen.append(signum)
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, cli_handler)
    try:
        with interrupts_held("never"):
            signal.signal(signal.SIGTERM, lambda *a: os._exit(15))  # as ray.init does
        assert signal.getsignal(signal.SIGTERM) is cli_handler
        with pytest.raises(KeyboardInterrupt):
            with interrupts_held("the block has run", then=lambda: seen.append("cleaned")):
                os.kill(os.getpid(), signal.SIGTERM)
                seen.append("block finished")
        assert seen == ["block finished", "cleaned", signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is cli_handler
    finally:
        signal.signal(signal.SIGTERM, before)


def test_with_ctrl_c_ignored_the_clis_sigterm_handler_still_survives_ray_init(ctrl_c_interrupts):
    """A background job (SIGINT ignored) is stopped with SIGTERM: ray.init must not take its handler away."""
    import os
    import signal

    from specpilot.train.scale.cluster import interrupts_held

    def cli_handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    before = signal.signal(signal.SIGTERM, cli_handler)
    try:
        with interrupts_held("never"):
            signal.signal(signal.SIGTERM, lambda *a: os._exit(15))  # as ray.init does
        assert signal.getsignal(signal.SIGTERM) is cli_handler
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)
