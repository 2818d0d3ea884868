"""One prompt: the tokens stage 2 trains on are the tokens chat/generate/eval send, token for token."""

from __future__ import annotations

import pytest

from acre_train.data.builtin import builtin_qa
from acre_train.data.chat import render_conversation
from acre_train.data.errors import InputProblems
from acre_train.data.prompt import PromptFormat, qa_messages
from acre_train.data.squad import build_long_qa, paragraphs_from_squad_json
from acre_train.data.tiny_tokenizer import tiny_tokenizer
from acre_train.modeling.interleave import IGNORE_INDEX


def _trained_prompt_ids(tok, example) -> list[int]:
    """The stage-2 render of a SQuAD long-QA example, up to where the labelled answer starts."""
    rendered = render_conversation(tok, example.messages, example.context)
    first_label = int((rendered.labels != IGNORE_INDEX).argmax())
    return rendered.input_ids[:first_label].tolist()


def _examples(tok, n=6):
    paragraphs = paragraphs_from_squad_json(builtin_qa(), "builtin", InputProblems())
    counts = [len(tok(p.context)["input_ids"]) for p in paragraphs]
    return [ex for _, ex in zip(range(n), build_long_qa(paragraphs, counts, context_tokens=600, seed=3))]


def _check(tok) -> None:
    prompt = PromptFormat(tok)
    for ex in _examples(tok):
        context = ex.messages[0]["content"][ex.context[1]:ex.context[2]]
        assert ex.messages == qa_messages(context, ex.meta["question"], ex.meta["answer"])
        inference = prompt.context_ids(context) + prompt.question_ids(ex.meta["question"])
        assert _trained_prompt_ids(tok, ex) == inference
        # The harness's prefix + context + suffix is the same render (documents aside).
        assert prompt.prefix_ids() + prompt.encode(context) == prompt.context_ids(context)


def test_stage2_render_equals_the_inference_render_token_for_token():
    tok = tiny_tokenizer()
    assert tok.chat_template  # ChatML, like Qwen2.5
    _check(tok)


def test_messages_data_in_the_project_prompt_is_cut_where_inference_cuts():
    """A conversation read from a messages JSONL carries no context span: the prompt's own question
    template marks where the context ends, so training still tokenizes as inference does."""
    tok = tiny_tokenizer()
    prompt = PromptFormat(tok)
    for ex in _examples(tok):
        # A context ending in a newline: without the cut its "\n" merges with the template's "\n\n".
        context = ex.messages[0]["content"][ex.context[1]:ex.context[2]] + "Ends with a line.\n"
        messages = qa_messages(context, ex.meta["question"], ex.meta["answer"], instruction="Read this.")
        rendered = render_conversation(tok, messages)  # no context span given
        first_label = int((rendered.labels != IGNORE_INDEX).argmax())
        expected = prompt.context_ids(context, instruction="Read this.") + prompt.question_ids(ex.meta["question"])
        assert rendered.input_ids[:first_label].tolist() == expected


def test_without_a_chat_template_the_prompt_is_plain_text():
    tok = tiny_tokenizer()
    tok.chat_template = None
    before, after = PromptFormat(tok).split("Who?", instruction="Read.")
    assert before == "Read.\n\n" and after == "\n\nAnswer the question using the context above.\nQuestion: Who?"


@pytest.mark.slow
def test_real_base_tokenizer_renders_training_and_inference_alike():
    from acre_train.base.fetch import base_dir

    folder = base_dir("qwen2.5-coder-0.5b-instruct")
    if not (folder / "acre_base.json").is_file():
        pytest.skip("the real base is not fetched (acre-train base fetch qwen2.5-coder-0.5b-instruct)")
    from acre_train.data.tokenizer import auto_tokenizer

    _check(auto_tokenizer(str(folder)))


@pytest.mark.parametrize("question", ["Who wrote the book?", "When did the war end", "What is 'x'?"])
def test_question_words_are_the_question_s_own_tokens_and_nothing_of_the_template(question):
    tok = tiny_tokenizer()
    prompt = PromptFormat(tok)
    ids = prompt.question_ids(question)
    words = prompt.question_words(ids)
    assert words is not None and len(words) == len(ids)
    own = [t for t, w in zip(ids, words) if w]
    first, last = words.index(True), len(words) - words[::-1].index(True)
    assert first > 0 and all(words[first:last]) and last < len(words)  # one run, inside the template
    assert tok.decode(own).strip() == question
    assert "Answer the question" in tok.decode(ids[: words.index(True)])
    assert prompt.question_words(ids[:-1]) is None  # not in the template: not guessed
    assert PromptFormat(None).question_words(ids) is None
