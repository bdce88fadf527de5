"""Language-model data (lowrank_jax.data.text and .tokenizer): the tokenizer of a checkpoint directory, chat
templates (against ``transformers``' ``apply_chat_template``), JSONL rows and their errors,
packing with segment ids, and the loss of a packed batch equal to that of its examples alone."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.common import llm_fixture
from lowrank_jax import data, models
from lowrank_jax.data import text, tokenizer

LINES = [
    "To be, or not to be, that is the Question:",
    "Whether 'tis Nobler in the minde to suffer",
    "The Slings and Arrowes of outragious Fortune,",
    "Or to take Armes against a Sea of troubles,",
] * 4
CHAT = [
    {"role": "system", "content": "Speak as in the Folio."},
    {"role": "user", "content": "To be, or not to be?"},
    {"role": "assistant", "content": "That is the Question."},
    {"role": "user", "content": "Whether 'tis Nobler?"},
    {"role": "assistant", "content": "In the minde to suffer."},
]
# The fixture's template with the assistant's text marked, as transformers' templates mark it.
GENERATION_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|im_end|>"
    "{% endgeneration %}{% else %}{{ message['content'] }}<|im_end|>{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _write_by_hand(directory, template=llm_fixture.CHAT_TEMPLATE, **config):
    """tokenizer.json + tokenizer_config.json written without transformers (older layout: the
    template in the config, AddedToken dicts)."""
    directory.mkdir(exist_ok=True)
    llm_fixture.train_tokenizer(LINES, vocab_size=300).save(str(directory / "tokenizer.json"))
    cfg = {
        "bos_token": {"content": "<|begin|>", "special": True},
        "eos_token": "<|im_end|>",
        "pad_token": "<|pad|>",
        "chat_template": template,
        **config,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg))
    return directory


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return data.load_tokenizer(_write_by_hand(tmp_path_factory.mktemp("tok")))


def test_special_tokens_and_round_trip(tok, tmp_path):
    assert tok.special_tokens == llm_fixture.SPECIAL_TOKENS
    assert tok.bos_token_id == 0 and tok.pad_token_id == 1 and tok.eos_token_id == 3
    ids = tok.encode(LINES[0])
    assert tok.decode(ids) == LINES[0] and ids[0] != tok.bos_token_id
    # add_bos_token in the config, and special_tokens_map.json wins over tokenizer_config.json
    d = _write_by_hand(tmp_path / "bos", add_bos_token=True)
    (d / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<|im_start|>"}))
    bos = data.load_tokenizer(d)
    assert bos.encode(LINES[0]) == [0, *ids] and bos.pad_token_id == 2
    assert bos.encode(LINES[0], add_special_tokens=False) == ids


def test_a_special_token_outside_the_vocabulary_is_named(tmp_path):
    d = _write_by_hand(tmp_path / "t", eos_token="</s>")
    with pytest.raises(ValueError, match=r"eos_token '</s>' is not in the tokenizer's vocabulary"):
        data.load_tokenizer(d)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        data.load_tokenizer(tmp_path)


def test_rows_put_the_loss_on_what_the_model_writes(tok):
    eos = "<|im_end|>"

    def target(row):
        ex = text.encode_row(tok, row)
        assert ex.tokens.dtype == np.int32 and ex.tokens.shape == ex.loss_mask.shape
        return tok.decode(ex.tokens[ex.loss_mask], skip_special_tokens=False)

    assert target({"text": LINES[0]}) == LINES[0] + eos
    assert target({"prompt": LINES[0] + "\n", "completion": LINES[1]}) == LINES[1] + eos
    assert target({"messages": CHAT}) == f"{CHAT[2]['content']}{eos}\n{CHAT[4]['content']}{eos}\n"
    # The same turns marked with {% generation %}: the marked text only.
    marked = data.Tokenizer(tok.backend, tok.special_tokens, chat_template=GENERATION_TEMPLATE)
    ex = text.encode_chat(marked, CHAT)
    assert marked.decode(ex.tokens[ex.loss_mask], skip_special_tokens=False) == (
        f"{CHAT[2]['content']}{eos}{CHAT[4]['content']}{eos}"
    )
    assert tokenizer.apply_chat_template(marked, CHAT) == tokenizer.apply_chat_template(tok, CHAT)


def test_chat_errors_say_what_to_do(tok):
    rewrites = "{% for m in messages %}{{ m['content'] if loop.last else '' }}{% endfor %}"
    odd = data.Tokenizer(tok.backend, tok.special_tokens, chat_template=rewrites)
    with pytest.raises(ValueError, match="mark them with {% generation %}"):
        text.encode_chat(odd, CHAT)
    with pytest.raises(ValueError, match='no "assistant" message'):
        text.encode_chat(tok, CHAT[:2])
    bare = data.Tokenizer(tok.backend, tok.special_tokens)
    with pytest.raises(ValueError, match=r'has no chat template .* use \{"text"\}'):
        tokenizer.apply_chat_template(bare, CHAT)
    raising = "{{ raise_exception('only user and assistant roles') }}"
    with pytest.raises(ValueError, match="chat template failed: .*only user and assistant"):
        tokenizer.apply_chat_template(data.Tokenizer(tok.backend, {}, chat_template=raising), CHAT)
    with pytest.raises(ValueError, match="does not parse"):
        data.Tokenizer(tok.backend, {}, chat_template="{% for %}")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"text": "a", ', "not valid JSON"),
        ('{"prompt": "a"}', r"exactly one of the keys .* this one has \['prompt'\]"),
        ('{"text": "a", "messages": []}', "exactly one of the keys"),
        ('{"text": 3}', '"text" must be a string, not int'),
        ('{"messages": [{"role": "user"}]}', r'message 0 \(user\) must have a string "content"'),
        ("[1, 2]", "must be a JSON object, not list"),
    ],
)
def test_a_bad_row_is_named_by_file_and_line(tmp_path, line, message):
    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "fine"}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"train.jsonl:3: .*{message}.*fix or remove the line"):
        text.read_jsonl(path)


def test_encoding_errors_name_the_line_too(tmp_path, tok):
    path = tmp_path / "chat.jsonl"
    rows = [{"text": "a"}, {"messages": [{"role": "user", "content": "hi"}]}]
    llm_fixture.write_jsonl(str(path), rows)
    with pytest.raises(ValueError, match=r"chat.jsonl:2: the conversation has no \"assistant\""):
        data.encode_jsonl(tok, path)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="has no rows"):
        text.read_jsonl(tmp_path / "empty.jsonl")


def test_pack_segments_positions_and_targets():
    ex = [
        text.Example(np.arange(1, 5, dtype=np.int32), np.ones(4, bool)),
        text.Example(np.arange(10, 13, dtype=np.int32), np.array([0, 1, 1], bool)),
        text.Example(np.arange(20, 30, dtype=np.int32), np.ones(10, bool)),  # cut to 8
    ]
    b = data.pack(ex, max_length=8, pad_id=99)
    np.testing.assert_array_equal(b["tokens"][0], [1, 2, 3, 4, 10, 11, 12, 99])
    np.testing.assert_array_equal(b["segment_ids"][0], [1, 1, 1, 1, 2, 2, 2, 0])
    np.testing.assert_array_equal(b["positions"][0], [0, 1, 2, 3, 0, 1, 2, 0])
    np.testing.assert_array_equal(b["loss_mask"][0], [0, 1, 1, 1, 0, 1, 1, 0])
    np.testing.assert_array_equal(b["tokens"][1], np.arange(20, 28))
    assert b["loss_mask"][1].sum() == 7 and b["tokens"].dtype == np.int32
    with pytest.raises(ValueError, match="max_length must be >= 2"):
        data.pack(ex, max_length=1)


def test_packed_loss_is_the_sum_of_each_example_alone(tok):
    """next_token_loss over a packed batch == the sum over the examples' own forwards."""
    examples = [text.encode_row(tok, {"text": line}) for line in LINES[:4]]
    examples.append(text.encode_row(tok, {"messages": CHAT}))
    config = models.DecoderConfig(
        vocab_size=tok.vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        dtype="float32",
    )
    model = models.DecoderLM(config)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    b = data.pack(examples, max_length=128, pad_id=tok.pad_token_id)
    assert len(b["tokens"]) < len(examples)  # several examples share a row
    # Each example alone: one row each, right-padded (segment 0: padding), in the same call.
    n = len(b["tokens"])
    alone = {k: np.zeros((len(examples), 128), v.dtype) for k, v in b.items()}
    for i, e in enumerate(examples):
        k = len(e.tokens)
        alone["tokens"][i, :k], alone["loss_mask"][i, :k] = e.tokens, e.loss_mask
        alone["segment_ids"][i, :k], alone["positions"][i, :k] = 1, np.arange(k)
    both = {k: np.concatenate([b[k], alone[k]]) for k in b}
    logits = jax.jit(model.apply)(
        variables, both["tokens"], segment_ids=both["segment_ids"], positions=both["positions"]
    )
    total, count = text.next_token_loss(logits[:n], b["tokens"], b["loss_mask"])
    expected, n_alone = text.next_token_loss(logits[n:], alone["tokens"], alone["loss_mask"])
    np.testing.assert_allclose(total, expected, rtol=1e-5)
    assert count == n_alone == sum(e.loss_mask[1:].sum() for e in examples)
    assert data.perplexity(float(total / count)) == pytest.approx(np.exp(total / count))


# ----------------------------------------------------------------------------------------------
# Against transformers (the peers tier).


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Two tokenizer directories saved by PreTrainedTokenizerFast.save_pretrained: the fixture's
    template, and one with {% generation %} blocks."""
    pytest.importorskip("transformers")
    backend = llm_fixture.train_tokenizer(LINES, vocab_size=300)
    out = []
    for template in (llm_fixture.CHAT_TEMPLATE, GENERATION_TEMPLATE):
        d = tmp_path_factory.mktemp("hf_tok")
        llm_fixture.write_tokenizer(str(d), backend, chat_template=template)
        out.append(d)
    return out


def test_transformers_chat_template_and_ids_equal_ours(hf_dirs):
    from transformers import AutoTokenizer

    for d in hf_dirs:
        ours, theirs = data.load_tokenizer(d), AutoTokenizer.from_pretrained(d)
        for messages in (CHAT, CHAT[1:3], CHAT[:2]):
            for prompt in (False, True):
                rendered = theirs.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=prompt
                )
                got = tokenizer.apply_chat_template(ours, messages, add_generation_prompt=prompt)
                assert got == rendered
        ids = theirs.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]
        assert text.encode_chat(ours, CHAT).tokens.tolist() == list(ids)
        for line in LINES[:4]:
            assert ours.encode(line) == theirs(line)["input_ids"]
            assert ours.decode(ours.encode(line)) == theirs.decode(theirs(line)["input_ids"])


def test_assistant_mask_equals_transformers_with_generation_blocks(hf_dirs):
    from transformers import AutoTokenizer

    d = hf_dirs[1]
    theirs = AutoTokenizer.from_pretrained(d).apply_chat_template(
        CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ours = text.encode_chat(data.load_tokenizer(d), CHAT)
    assert ours.tokens.tolist() == list(theirs["input_ids"])
    assert ours.loss_mask.astype(int).tolist() == list(theirs["assistant_masks"])
    # Without the marks (the plain template), the same tokens are targets plus each turn's "\n".
    plain = text.encode_chat(data.load_tokenizer(hf_dirs[0]), CHAT)
    assert plain.loss_mask.sum() >= ours.loss_mask.sum()
