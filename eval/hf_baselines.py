"""transformers' own decoding as baselines: `hf_generate` (target-only generate) and `hf_assisted` (assisted
generation with the same draft).

Both call `pair.target.generate` on one prompt, with the same sampling (temperature, top-k, top-p) and EOS as our
decoder. Token arrival times come from a streamer that `generate()` calls once per step (one token for plain
generation, the accepted tokens plus the bonus for assisted generation), so TTFT, inter-token latency and the
tokens per target forward (tau) are observed rather than assumed. Assisted generation reads its drafting
settings from the draft's own `generation_config` (passing them to generate() does not reach the assistant), so
`configure_assistant` writes them there.
"""
from __future__ import annotations

import time

import torch
from transformers.generation.streamers import BaseStreamer

from specpilot.drafting.timing import synchronize
from specpilot.eval.metrics import RunRecord


class TimingStreamer(BaseStreamer):
    """Records, for every new token, the perf_counter offset from `start` at which generate() pushed it.
    generate() first pushes the prompt, which is skipped."""

    def __init__(self, start: float, device: torch.device) -> None:
        self.start = start
        self.device = device
        self.token_times: list[float] = []
        self._seen_prompt = False

    def put(self, value) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        synchronize(self.device)  # the tokens exist once the kernels that made them finished
        now = time.perf_counter() - self.start
        self.token_times.extend([now] * int(value.numel()))

    def end(self) -> None:
        pass


def configure_assistant(draft, *, num_assistant_tokens: int, schedule: str = "constant",
                        confidence_threshold: float | None = 0.4) -> dict:
    """Write the assisted-generation settings into the draft's generation_config; return them for the report.

    schedule "constant" keeps `num_assistant_tokens` fixed (HF's default schedule); HF's default
    confidence threshold (0.4) stops drafting early when the draft is unsure.
    """
    gc = draft.generation_config
    gc.num_assistant_tokens = int(num_assistant_tokens)
    gc.num_assistant_tokens_schedule = schedule
    gc.assistant_confidence_threshold = confidence_threshold
    return {"num_assistant_tokens": int(num_assistant_tokens), "num_assistant_tokens_schedule": schedule,
            "assistant_confidence_threshold": confidence_threshold}


class HFGenerate:
    """One of transformers' generate() modes as an evaluation method (see the module docstring)."""

    def __init__(self, pair, *, assisted: bool, name: str, assistant=None) -> None:
        self.pair = pair
        self.assisted = assisted
        self.name = name
        self.assistant = assistant if assistant is not None else pair.draft  # a separate draft LM

    def describe(self) -> dict:
        out = {"name": self.name, "impl": "transformers.generate"}
        if self.assisted:
            gc = self.assistant.generation_config
            out.update(num_assistant_tokens=gc.num_assistant_tokens,
                       num_assistant_tokens_schedule=gc.num_assistant_tokens_schedule,
                       assistant_confidence_threshold=gc.assistant_confidence_threshold)
        return out

    def __call__(self, ids: list[int], *, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                 seed: int | None) -> RunRecord:
        pair = self.pair
        device = pair.device
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        kwargs = dict(max_new_tokens=max_new_tokens, min_new_tokens=0, attention_mask=torch.ones_like(input_ids),
                      eos_token_id=list(pair.eos_token_ids) or None,
                      pad_token_id=pair.eos_token_id if pair.eos_token_id is not None else 0)
        if temperature > 0:
            # top_k=0 disables top-k in transformers as in our sampler; the explicit value overrides the model's
            # generation_config default (often 50)
            kwargs.update(do_sample=True, temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))
            if seed is not None:
                torch.manual_seed(int(seed))
        else:
            kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        if self.assisted:
            kwargs["assistant_model"] = self.assistant
        synchronize(device)
        streamer = TimingStreamer(time.perf_counter(), device)
        with torch.inference_mode():
            out = pair.target.generate(input_ids, streamer=streamer, **kwargs)
        tokens = [int(t) for t in out[0, len(ids):].tolist()]
        times = streamer.token_times[: len(tokens)]
        return RunRecord(prompt_id="", method=self.name, tokens=tokens, wall_s=0.0, token_times=times)
