"""transformers' own decoding as baselines: `hf_generate` (target-only generate) and `hf_assisted` (assisted
generation with the same draft).

Both call `pair.target.generate` on one prompt, with the same sampling (temperature, top-k, top-p) and EOS as our
decoder. Token arrival times come from a streamer that `generate()` calls once per step (one token for plain
generation, the accepted tokens plus the bonus for assisted generation), so TTFT, inter-token latency and the
tokens per target forward (tau) are observed rather than assumed. Assisted generation reads its drafting
settings from the draft's own `generation_config` (passing them to generate() does not reach the assistant), so
`configure_assistant` writes them there. Stop strings end generate() by our decoder's rule (`GeneratedTextStop`:
the generated text only, as vLLM; transformers' own `stop_strings` also match a string begun in the prompt), stop
token ids join the end ids, and ignore_eos gives generate() no end id, so both baselines end where `ar` ends.
"""
from __future__ import annotations

import time

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from specpilot.drafting.stopping import StopStrings, request_ending
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


class GeneratedTextStop(StoppingCriteria):
    """A stopping criterion for generate(): True once a token completes one of `stops` in the text generated after
    the first `prompt_len` tokens (`StopStrings.cut`, the rule of our decoder); `stop_at` is then the output length
    that keeps that token (assisted generation may append tokens past it in the same step)."""

    def __init__(self, stops: StopStrings, prompt_len: int) -> None:
        self.stops, self.prompt_len = stops, prompt_len
        self.checked = 0
        self.stop_at: int | None = None

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        generated = input_ids[0, self.prompt_len:].tolist()
        if self.stop_at is None and len(generated) > self.checked:
            cut = self.stops.cut(generated[: self.checked], generated[self.checked:])
            if cut is not None:
                self.stop_at = self.checked + cut
            self.checked = len(generated)
        return torch.full((input_ids.shape[0],), self.stop_at is not None, dtype=torch.bool, device=input_ids.device)


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
                 seed: int | None, stop_strings=None, stop_token_ids=None, ignore_eos: bool = False) -> RunRecord:
        pair = self.pair
        device = pair.device
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        # an empty list, not None: None would fall back to the model's generation_config end ids (ignore_eos)
        eos, stops, stop_ids = request_ending(pair, stop_strings, stop_token_ids, ignore_eos)
        ends = list(eos) + list(stop_ids)
        kwargs = dict(max_new_tokens=max_new_tokens, min_new_tokens=0, attention_mask=torch.ones_like(input_ids),
                      eos_token_id=list(dict.fromkeys(ends)) if ends or ignore_eos else None,
                      pad_token_id=pair.eos_token_id if pair.eos_token_id is not None else 0)
        criterion = GeneratedTextStop(stops, len(ids)) if stops is not None else None
        if criterion is not None:
            kwargs["stopping_criteria"] = StoppingCriteriaList([criterion])
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
        if criterion is not None and criterion.stop_at is not None:
            tokens = tokens[: criterion.stop_at]
        times = streamer.token_times[: len(tokens)]
        return RunRecord(prompt_id="", method=self.name, tokens=tokens, wall_s=0.0, token_times=times)
