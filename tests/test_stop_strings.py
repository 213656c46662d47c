"""Stop strings and streamers (transformers' generate(stop_strings=..., streamer=...), vLLM's `stop`): speculative,
batched and target-only decoding end on the same token, the one that completes the string in the generated text,
and a streamer receives the prompt, then exactly the output tokens, then end()."""
from __future__ import annotations

import pytest
import torch
from transformers import TextStreamer

from specpilot.drafting import ModelPair, SpeculativeDecoder, TreeConfig, autoregressive_generate
from specpilot.drafting.batch_ar import autoregressive_generate_batch
from specpilot.drafting.stopping import StopStrings, truncate_emitted
from specpilot.policies import FixedController

PROMPT = "def f(x):\n"
OTHER = "    return"
NEW = 40


class CharTokenizer:
    """Token i decodes to chr(ord('a') + i); token 0 is special (decodes to nothing without special tokens)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids if not (skip_special_tokens and i == 0))


def ids(text: str) -> list[int]:
    return [ord(c) - ord("a") for c in text]


@pytest.mark.parametrize("generated, emitted, stops, expected", [
    ("xyz", "abcde", ["cd"], 4),              # completed by the 4th emitted token
    ("xyc", "dab", ["cd"], 1),                # begun before the cycle, completed by its first token
    ("xyz", "abc", ["cd"], None),
    ("xyz", "abcdc", ["dc", "bc"], 3),        # the first completed string decides
])
def test_cut_keeps_the_tokens_up_to_the_one_completing_a_stop_string(generated, emitted, stops, expected):
    assert StopStrings(stops, CharTokenizer()).cut(ids(generated), ids(emitted)) == expected


def test_truncation_order_end_id_budget_then_stop_strings():
    stops = StopStrings("cd", CharTokenizer())
    assert truncate_emitted(ids("abcde"), [], 10, (), stops) == (ids("abcd"), "stop")
    assert truncate_emitted(ids("abcde"), [], 3, (), stops) == (ids("abc"), "length")
    assert truncate_emitted(ids("abcde"), [], 10, (ids("b")[0],), stops) == (ids("ab"), "eos")
    assert truncate_emitted(ids("abcde"), [], 10, (), None) == (ids("abcde"), None)
    # an end id whose own text completes the stop string ends by "eos", as target-only decoding says (vLLM's order)
    assert truncate_emitted(ids("abcde"), [], 10, (ids("d")[0],), stops) == (ids("abcd"), "eos")


def test_special_tokens_in_the_lookback_do_not_hide_the_start_of_a_stop_string():
    """Special tokens decode to nothing: a run of them between a stop string's start and its end must not push the
    start out of the text searched."""
    tokenizer = CharTokenizer()
    generated = ids("xbcd") + [0] * 40  # token 0 ("a") is special: no text
    assert StopStrings("bcdefg", tokenizer).cut(generated, ids("efg")) == 3


def test_a_stop_string_that_is_not_valid_utf8_is_named():
    with pytest.raises(ValueError, match="a stop string is not valid UTF-8"):
        StopStrings("x\udcff", CharTokenizer())


@pytest.mark.parametrize("stops", ["", [], [""], ["ok", 3], 5])
def test_bad_stop_strings_are_refused(stops):
    if stops == []:  # an empty list means none, as generate() takes it
        assert StopStrings.of(stops, CharTokenizer()) is None
        return
    with pytest.raises(ValueError, match="stop_strings must be"):
        StopStrings.of(stops, CharTokenizer())


def test_stop_strings_need_a_tokenizer():
    with pytest.raises(ValueError, match="need the pair's tokenizer"):
        StopStrings("x", None)


@pytest.fixture(scope="module")
def pair(saved_pair):
    return ModelPair.from_pretrained(saved_pair / "target", saved_pair / "draft")


@pytest.fixture(scope="module")
def case(pair):
    """(stop string, target-only greedy tokens it ends, the full reference): a stop string cut out of the middle of
    the target's own greedy text, and the shortest prefix of that output whose text holds it."""
    ref = autoregressive_generate(pair, PROMPT, max_new_tokens=NEW).tokens
    text = pair.decode(ref)
    found = {}  # the random target's bytes decode mostly to U+FFFD: readable pieces, the latest-ending one taken
    for length in (1, 2, 3):  # (later stops fall inside long accepted drafts, which the cut must split)
        for start in range(len(text) - length + 1):
            stop = text[start:start + length]
            if stop.strip() and "\ufffd" not in stop:
                found[stop] = next(k for k in range(1, len(ref) + 1) if stop in pair.decode(ref[:k]))
    usable = [(k, stop) for stop, k in found.items() if 3 <= k <= len(ref) - 3]
    assert usable, f"no usable stop string in the tiny target's text {text!r}"
    k, stop = max(usable)
    return stop, ref[:k], ref


def test_target_only_decoding_ends_on_the_token_completing_the_stop_string(pair, case):
    stop, expected, _ = case
    out = autoregressive_generate(pair, PROMPT, max_new_tokens=NEW, stop_strings=[stop, "never in this text"])
    assert out.tokens == expected and out.finished_by == "stop" and stop in out.text


@pytest.mark.parametrize("width, depth, size", [(1, 4, 4), (3, 3, 8), (4, 6, 24)])
def test_speculative_decoding_stops_where_target_only_decoding_does(pair, case, width, depth, size):
    stop, expected, _ = case
    decoder = SpeculativeDecoder(pair, TreeConfig(width=width, max_depth=depth, max_size=size))
    out = decoder.generate(PROMPT, controller=FixedController(depth, size), max_new_tokens=NEW, stop_strings=stop)
    assert out.tokens == expected and out.finished_by == "stop"
    assert sum(c.emitted for c in out.cycles) == len(expected)


def test_batched_rows_each_stop_where_they_would_alone(pair, case):
    stop, expected, _ = case
    other = autoregressive_generate(pair, OTHER, max_new_tokens=NEW, stop_strings=stop)
    decoder = SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=4, max_size=8))
    for outputs in (decoder.generate_batch([PROMPT, OTHER], controller=FixedController(4, 8), max_new_tokens=NEW,
                                           stop_strings=[stop]),
                    autoregressive_generate_batch(pair, [PROMPT, OTHER], max_new_tokens=NEW, stop_strings=[stop])):
        assert outputs[0].tokens == expected and outputs[0].finished_by == "stop"
        assert outputs[1].tokens == other.tokens and outputs[1].finished_by == other.finished_by


def test_sampled_decoding_stops_on_the_stop_string_too(pair, case):
    stop = case[0]
    decoder = SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=4, max_size=8))
    for seed in range(4):
        out = decoder.generate(PROMPT, max_new_tokens=NEW, temperature=1.0, seed=seed, stop_strings=stop)
        text = pair.decode(out.tokens)
        if out.finished_by == "stop":
            assert stop in text and stop not in pair.decode(out.tokens[:-1])
        else:
            assert stop not in text


class Recorder:
    """A transformers streamer (put / end) that keeps what it was given."""

    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        assert value.dim() == 2 and value.shape[0] == 1
        self.puts.append(value[0].tolist())

    def end(self):
        self.ended += 1


@pytest.mark.parametrize("method", ["speculative", "target_only"])
def test_a_streamer_gets_the_prompt_then_every_output_token_then_end(pair, case, method):
    stop = case[0]
    streamer = Recorder()
    if method == "speculative":
        decoder = SpeculativeDecoder(pair, TreeConfig(width=3, max_depth=4, max_size=8))
        out = decoder.generate(PROMPT, max_new_tokens=NEW, streamer=streamer, stop_strings=stop)
        assert len(streamer.puts) == 1 + len(out.cycles)  # one put per cycle, as generate()'s assisted decoding
    else:
        out = autoregressive_generate(pair, PROMPT, max_new_tokens=NEW, streamer=streamer, stop_strings=stop)
    assert streamer.puts[0] == pair.encode(PROMPT)
    assert [t for put in streamer.puts[1:] for t in put] == out.tokens and streamer.ended == 1


def test_transformers_text_streamer_prints_the_output_text(pair, case, capsys):
    _, _, ref = case
    decoder = SpeculativeDecoder(pair, TreeConfig(width=3, max_depth=4, max_size=8))
    out = decoder.generate(PROMPT, max_new_tokens=NEW, streamer=TextStreamer(pair.tokenizer, skip_prompt=True,
                                                                             skip_special_tokens=True))
    assert out.tokens == ref
    assert capsys.readouterr().out == out.text + "\n"


def test_no_stop_strings_change_nothing(pair, case):
    _, _, ref = case
    decoder = SpeculativeDecoder(pair, TreeConfig(width=3, max_depth=4, max_size=8))
    for stops in (None, []):
        assert decoder.generate(PROMPT, max_new_tokens=NEW, stop_strings=stops).tokens == ref
    assert torch.is_inference_mode_enabled() is False


def test_the_end_token_completing_a_stop_string_ends_every_path_by_eos(tmp_path):
    """Target-only, speculative and batched decoding give one reason when the end token's own text completes a stop
    string (an end id that is no special token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tiny import noisy_copy, tiny_model

    vocab = {chr(ord("a") + i): i for i in range(26)} | {"!": 26}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok)  # "!" (the end id) decodes to "!": not special
    target = tiny_model(vocab=27, eos=26, seed=3)
    with torch.no_grad():
        target.lm_head.bias = None
        target.lm_head.weight[26] += 50.0  # the end id first, whatever the prompt
    target_pair = ModelPair(target, noisy_copy(target, 0.01), tokenizer)
    decoder = SpeculativeDecoder(target_pair, TreeConfig(width=2, max_depth=3, max_size=6))
    outputs = [autoregressive_generate(target_pair, [1, 2], max_new_tokens=4, stop_strings="!"),
               decoder.generate([1, 2], max_new_tokens=4, stop_strings="!"),
               decoder.generate_batch([[1, 2]], max_new_tokens=4, stop_strings="!")[0],
               autoregressive_generate_batch(target_pair, [[1, 2]], max_new_tokens=4, stop_strings="!")[0]]
    assert outputs[0].tokens[-1] == 26 and "!" not in tokenizer.decode(outputs[0].tokens[:-1])
    assert [(o.tokens, o.finished_by) for o in outputs] == [(outputs[0].tokens, "eos")] * 4


@pytest.mark.parametrize("stream", [False, True])
def test_the_cli_stops_on_stop_and_streams_the_same_text(saved_pair, pair, case, capsys, stream):
    from specpilot.cli import main

    stop, expected, _ = case
    args = ["generate", "--prompt", PROMPT, "--target", str(saved_pair / "target"), "--draft",
            str(saved_pair / "draft"), "--width", "2", "--depth", "3", "--size", "6", "--max-new-tokens", str(NEW),
            "--stop", stop, "--stop", "never in this text", "--stop", "\n\n\n\n\n\n", "--compare",
            *(["--stream"] if stream else [])]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith(pair.decode(expected) + "\n")
    assert f"[{len(expected)} tokens," in out and "identical to target-only" in out


def test_cut_matches_a_search_of_the_whole_text_with_multi_byte_characters(saved_pair):
    """A byte-level tokenizer splits 'é', '中' or an emoji into several tokens: the cut still lands on the token
    that completes the string in the whole generated text, wherever the cycle boundary falls."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(saved_pair / "target")
    text = "x = 1\n# café 中文字符串 🙂 done\nreturn x + 1\n" * 2
    tokens = tokenizer.encode(text)
    whole = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    assert whole(tokens) == text and len(tokens) > len(text)  # multi-byte characters span several tokens
    for stop in ["中文字符", "é 中", "🙂 d", "return x", "串 🙂", "\nre"]:
        first = next(k for k in range(1, len(tokens) + 1) if stop in whole(tokens[:k]))
        checker = StopStrings(stop, tokenizer)
        for split in range(0, first):
            for size in (1, 3, 9):  # cycles of several tokens
                emitted = tokens[split: split + size]
                expected = first - split if split + size >= first else None
                assert checker.cut(tokens[:split], emitted) == expected, (stop, split, size)


# -- vLLM's stop_token_ids and ignore_eos ----------------------------------------------------------------------------

@pytest.mark.parametrize("ids, expected", [(None, ()), ([], ()), (3, (3,)), ([4, 1, 4], (4, 1)),
                                           (torch.tensor(7), (7,)), (torch.tensor([2, 5]), (2, 5))])
def test_stop_token_ids_are_read_as_vllm_takes_them(ids, expected):
    from specpilot.drafting.stopping import check_stop_token_ids

    assert check_stop_token_ids(ids, 10) == expected


@pytest.mark.parametrize("ids, error", [([10], ValueError), ([-1], ValueError), (["a"], TypeError), ("3", TypeError),
                                        (2.5, TypeError), (True, TypeError), ([True], TypeError)])
def test_bad_stop_token_ids_are_refused(ids, error):
    from specpilot.drafting.stopping import check_stop_token_ids

    with pytest.raises(error, match="stop"):
        check_stop_token_ids(ids, 10)


def test_a_stop_token_id_ends_every_path_on_its_first_occurrence(pair, case):
    _, _, ref = case
    token = ref[len(ref) // 2]
    k = ref.index(token) + 1
    decoder = SpeculativeDecoder(pair, TreeConfig(width=3, max_depth=6, max_size=16))
    outputs = [autoregressive_generate(pair, PROMPT, max_new_tokens=NEW, stop_token_ids=[token]),
               decoder.generate(PROMPT, controller=FixedController(6, 16), max_new_tokens=NEW, stop_token_ids=token),
               decoder.generate_batch([PROMPT, OTHER], max_new_tokens=NEW, stop_token_ids=[token])[0],
               autoregressive_generate_batch(pair, [PROMPT, OTHER], max_new_tokens=NEW, stop_token_ids=[token])[0]]
    assert [(o.tokens, o.finished_by) for o in outputs] == [(ref[:k], "stop")] * 4


def test_ignore_eos_decodes_the_whole_budget_on_every_path(tmp_path):
    """A target that ends at once: with ignore_eos every path decodes past its end token, to the same budget."""
    from tiny import noisy_copy, tiny_model

    target = tiny_model(vocab=40, eos=None, seed=4)
    prompts = [[1, 2, 3], [5, 6], [7]]
    end = autoregressive_generate(ModelPair(target, noisy_copy(target, 0.05)), prompts[0], max_new_tokens=4).tokens[3]
    target.generation_config.eos_token_id = target.config.eos_token_id = end  # met by the 4th token of prompt 0
    end_pair = ModelPair(target, noisy_copy(target, 0.05))
    decoder = SpeculativeDecoder(end_pair, TreeConfig(width=2, max_depth=4, max_size=8))
    plain = [autoregressive_generate(end_pair, p, max_new_tokens=24).finished_by for p in prompts]
    runs = {"ar": [autoregressive_generate(end_pair, p, max_new_tokens=24, ignore_eos=True) for p in prompts],
            "spec": [decoder.generate(p, max_new_tokens=24, ignore_eos=True) for p in prompts],
            "batch": decoder.generate_batch(prompts, max_new_tokens=24, ignore_eos=True),
            "ar_batch": autoregressive_generate_batch(end_pair, prompts, max_new_tokens=24, ignore_eos=True)}
    for name, outputs in runs.items():
        assert [o.tokens for o in outputs] == [o.tokens for o in runs["ar"]], name
        assert all(len(o.tokens) == 24 and o.finished_by == "length" for o in outputs), name
    assert plain[0] == "eos" and end in runs["ar"][0].tokens[:4]  # without it prompt 0 ended; with it, ran on
    with pytest.raises(TypeError, match="ignore_eos"):
        decoder.generate([1], ignore_eos="yes")


def test_the_cli_takes_stop_token_ids_and_ignore_eos(saved_pair, pair, case, capsys):
    from specpilot.cli import main

    _, _, ref = case
    token = ref[len(ref) // 2]
    k = ref.index(token) + 1
    base = ["generate", "--prompt", PROMPT, "--target", str(saved_pair / "target"), "--draft",
            str(saved_pair / "draft"), "--width", "2", "--depth", "3", "--size", "6", "--max-new-tokens", str(NEW)]
    assert main([*base, "--stop-token-id", str(token), "--ignore-eos", "--compare"]) == 0
    out = capsys.readouterr().out
    assert f"[{k} tokens," in out and "identical to target-only" in out
    assert main([*base, "--stop-token-id", str(pair.vocab_size)]) == 2
    assert "stop token id must be an integer in 0.." in capsys.readouterr().err
