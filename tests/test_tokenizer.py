"""Tokenizer: round trip, stop set (spec §5.2), chat templates (HF-compatible rendering),
missing files, and streaming detokenisation that never emits half a character."""

import json
from pathlib import Path

import numpy as np
import pytest

from dflash2_numba import tiny
from dflash2_numba.errors import ChatTemplateError, ChatTemplateMissingError, CheckpointNotFoundError, ConfigError
from dflash2_numba.tokenizer import StreamDecoder, Tokenizer

# characters absent from the training corpus, so byte-level BPE splits them into byte tokens
SPLIT_TEXT = "Tea 🦜🫖 and 龘靐 then naïve café — done. 𝄞 end"


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return tiny.write_target(tmp_path_factory.mktemp("q") / "qwen3", num_hidden_layers=1)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return tiny.write_target(tmp_path_factory.mktemp("l") / "llama", architecture="llama",
                             num_hidden_layers=1)


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj))


def edit_json(path: Path, **changes) -> None:
    obj = json.loads(path.read_text())
    for k, v in changes.items():
        if v is tiny.DELETE:
            obj.pop(k, None)
        else:
            obj[k] = v
    write_json(path, obj)


# ---------------------------------------------------------------- ids <-> text
@pytest.mark.parametrize("text", ["Hello, world!", "The quick brown fox.\n\n  def f(x): return x",
                                  SPLIT_TEXT, "中文：你好，世界！", "", "<|im_start|>user\nhi<|im_end|>"])
def test_round_trip(qwen_dir, text):
    tok = Tokenizer.from_dir(qwen_dir)
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_special_tokens_are_single_ids(qwen_dir):
    tok = Tokenizer.from_dir(qwen_dir)
    ids = tok.encode("<|im_start|>user<|im_end|>")
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids[-1] == tok.token_to_id("<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "user"


def test_encoding_matches_transformers(qwen_dir, llama_dir):
    """transformers' tokenizer on the same directory is the independent reference."""
    transformers = pytest.importorskip("transformers")
    for d in (qwen_dir, llama_dir):
        ours, ref = Tokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(d)
        for text in ("Hello there", SPLIT_TEXT):
            assert ours.encode(text) == ref.encode(text)
            assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
        assert ours.vocab_size == len(ref)


def test_llama_bos_once_in_plain_and_chat_prompts(llama_dir):
    tok = Tokenizer.from_dir(llama_dir)
    bos = tok.token_to_id("<|begin_of_text|>")
    assert tok.bos_token_id == bos
    plain = tok.encode_prompt("hi")
    chat = tok.encode_prompt("hi", chat=True)
    assert plain[0] == bos and plain.count(bos) == 1
    assert chat[0] == bos and chat.count(bos) == 1  # the template holds BOS; encode adds none


def test_add_bos_token_prepends_when_the_post_processor_does_not(tmp_path, qwen_dir):
    d = tiny.write_target(tmp_path / "q", num_hidden_layers=1)
    edit_json(d / "tokenizer_config.json", add_bos_token=True, bos_token="<|endoftext|>")
    tok = Tokenizer.from_dir(d)
    bos = tok.token_to_id("<|endoftext|>")
    assert tok.encode("hi") == [bos] + Tokenizer.from_dir(qwen_dir).encode("hi")
    assert tok.encode("hi", add_special_tokens=False)[0] != bos


# ---------------------------------------------------------------- stop set
@pytest.mark.parametrize("gen_eos,cfg_eos", [([11, 12], 13), (11, [12, 13]), (None, 13),
                                             ([11], None), (14, 14)])
def test_stop_ids_union_of_generation_config_config_and_extra(tmp_path, gen_eos, cfg_eos):
    d = tiny.write_target(tmp_path / "t", num_hidden_layers=1)
    edit_json(d / "generation_config.json", eos_token_id=gen_eos if gen_eos is not None else tiny.DELETE)
    edit_json(d / "config.json", eos_token_id=cfg_eos)
    as_set = lambda v: set() if v is None else set(v if isinstance(v, list) else [v])  # noqa: E731
    expected = as_set(gen_eos) | as_set(cfg_eos)
    tok = Tokenizer.from_dir(d)
    assert tok.stop_ids() == frozenset(expected)
    assert tok.stop_ids(extra=[99, 11]) == frozenset(expected | {99, 11})


def test_stop_ids_without_generation_config_file(tmp_path):
    d = tiny.write_target(tmp_path / "t", num_hidden_layers=1)
    (d / "generation_config.json").unlink()
    cfg_eos = json.loads((d / "config.json").read_text())["eos_token_id"]
    assert Tokenizer.from_dir(d).stop_ids() == {cfg_eos}


def test_stop_ids_fall_back_to_the_tokenizer_eos_token_only_when_no_id_is_given(tmp_path):
    d = tiny.write_target(tmp_path / "t", num_hidden_layers=1)
    (d / "generation_config.json").unlink()
    edit_json(d / "config.json", eos_token_id=None)
    tok = Tokenizer.from_dir(d)
    assert tok.stop_ids() == {tok.token_to_id("<|im_end|>")}


def test_bad_eos_token_id_is_refused_by_name(tmp_path):
    d = tiny.write_target(tmp_path / "t", num_hidden_layers=1)
    edit_json(d / "generation_config.json", eos_token_id="2")
    with pytest.raises(ConfigError, match="generation_config.json.*eos_token_id"):
        Tokenizer.from_dir(d)


# ---------------------------------------------------------------- chat template
def test_chat_template_with_and_without_thinking(qwen_dir):
    tok = Tokenizer.from_dir(qwen_dir)
    base = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template("hi") == base + "<think>\n\n</think>\n\n"  # default: off
    assert tok.apply_chat_template("hi", enable_thinking=True) == base
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
            {"role": "assistant", "content": "A"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
        "<|im_start|>assistant\nA<|im_end|>\n")
    with pytest.raises(ChatTemplateError, match="Unknown role: robot"):  # raise_exception, named
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_chat_template_renders_as_transformers_does(tmp_path, llama_dir):
    """A template sensitive to trim_blocks/lstrip_blocks, tojson and bos/eos strings, rendered
    by transformers and by us."""
    transformers = pytest.importorskip("transformers")
    d = tiny.write_target(tmp_path / "t", architecture="llama", num_hidden_layers=1, chat_template=False)
    (d / "chat_template.jinja").write_text(
        "{{ bos_token }}\n"
        "{% for m in messages %}\n"
        "    {% if m.role == 'user' %}\n"
        "[U] {{ m.content | tojson }}\n"
        "    {% else %}\n"
        "[A] {{ m.content }}{{ eos_token }}\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}[A]{% endif %}\n"
        "{% if enable_thinking %}<think>{% endif %}")
    msgs = [{"role": "user", "content": "héllo <b>\"x\"</b> 🦜"}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "again"}]
    ref_tok = transformers.AutoTokenizer.from_pretrained(d)
    tok = Tokenizer.from_dir(d)
    for thinking in (False, True):
        ref = ref_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                          enable_thinking=thinking)
        assert tok.apply_chat_template(msgs, enable_thinking=thinking) == ref
    # and the tiny model's own template, as written to tokenizer_config.json
    ref_tok = transformers.AutoTokenizer.from_pretrained(llama_dir)
    for thinking in (False, True):
        ref = ref_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                          enable_thinking=thinking)
        assert Tokenizer.from_dir(llama_dir).apply_chat_template(msgs, enable_thinking=thinking) == ref


def test_chat_template_jinja_file_is_found(tmp_path):
    d = tiny.write_target(tmp_path / "t", num_hidden_layers=1, chat_template=False)
    (d / "chat_template.jinja").write_text("{% for m in messages %}<{{ m.content }}>{% endfor %}")
    assert Tokenizer.from_dir(d).apply_chat_template("x") == "<x>"


def test_missing_chat_template_names_the_directory_and_both_places(tmp_path):
    d = tiny.write_target(tmp_path / "t", num_hidden_layers=1, chat_template=False)
    tok = Tokenizer.from_dir(d)
    with pytest.raises(ChatTemplateMissingError) as e:
        tok.encode_prompt("hi", chat=True)
    msg = str(e.value)
    assert str(d) in msg and "tokenizer_config.json" in msg and "chat_template.jinja" in msg
    assert tok.encode_prompt("hi") == tok.encode("hi")  # plain prompts still work


def test_missing_tokenizer_json_names_the_path(tmp_path):
    d = tiny.write_target(tmp_path / "t", num_hidden_layers=1)
    (d / "tokenizer.json").unlink()
    with pytest.raises(CheckpointNotFoundError, match=str(d / "tokenizer.json")) as e:
        Tokenizer.from_dir(d)
    assert isinstance(e.value, FileNotFoundError)
    with pytest.raises(CheckpointNotFoundError, match="nowhere"):
        Tokenizer.from_dir(tmp_path / "nowhere")


# ---------------------------------------------------------------- streaming
def test_split_text_really_splits_characters(qwen_dir):
    """Precondition of the streaming tests: some single tokens decode to a partial char."""
    tok = Tokenizer.from_dir(qwen_dir)
    pieces = [tok.decode([i]) for i in tok.encode(SPLIT_TEXT)]
    assert sum("\ufffd" in p for p in pieces) >= 4


@pytest.mark.parametrize("chunking", ["single", "random"])
def test_stream_decoder_never_emits_partial_characters(qwen_dir, chunking):
    tok = Tokenizer.from_dir(qwen_dir)
    ids = tok.encode(SPLIT_TEXT + "\n" + SPLIT_TEXT[::-1])
    full = tok.decode(ids)
    assert "\ufffd" not in full
    rng = np.random.default_rng(0)
    dec = StreamDecoder(tok)
    emitted, pos = "", 0
    while pos < len(ids):
        n = 1 if chunking == "single" else int(rng.integers(1, 5))
        chunk, pos = ids[pos:pos + n], pos + n
        piece = dec.feed(chunk if len(chunk) > 1 else chunk[0])
        assert "\ufffd" not in piece
        emitted += piece
        assert full.startswith(emitted)
        # exactly the longest token prefix that ends on a complete character has been shown
        k = next(k for k in range(pos, -1, -1) if not tok.decode(ids[:k]).endswith("\ufffd"))
        assert emitted == tok.decode(ids[:k])
    assert emitted == full  # every character completed before the end
    assert dec.flush() == ""


def test_stream_decoder_flush_emits_the_dangling_bytes(qwen_dir):
    tok = Tokenizer.from_dir(qwen_dir)
    ids = tok.encode("ok 🦜")
    cut = next(k for k in range(len(ids), 0, -1) if tok.decode(ids[:k]).endswith("\ufffd"))
    dec = tok.stream_decoder()
    held = dec.feed(ids[:cut])  # several ids at once, the last ones a partial character
    k = next(k for k in range(cut, -1, -1) if not tok.decode(ids[:k]).endswith("\ufffd"))
    assert held == tok.decode(ids[:k]) and held.startswith("ok")
    assert held + dec.flush() == tok.decode(ids[:cut])  # the partial char, as decode shows it
