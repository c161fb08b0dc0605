"""Chat completions render the run's chat template as transformers' ``apply_chat_template``
does, and answer what ``generate_text`` gives the rendered prompt alone."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("jinja2")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from handformer.config import ModelConfig  # noqa: E402
from handformer.generate import generate_text  # noqa: E402
from handformer.models.decoder_lm import DecoderLM  # noqa: E402
from handformer.serve.chat import ChatTemplate, ChatTemplateError  # noqa: E402
from handformer.tokenizers import BPETokenizer  # noqa: E402
from tests.serve.server import serving  # noqa: E402

# Qwen's shape of template, with the features templates use: the special tokens' strings,
# loop variables, tojson, a refusal through raise_exception and whitespace control.
TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' ~ message['role']) }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n"
    "{% if loop.last and message['role'] == 'system' %}"
    "{{ raise_exception('a conversation cannot end with a system message') }}{% endif %}"
    "{% endfor %}\n"
    "  {% if add_generation_prompt %}<|im_start|>assistant {{ 'meta' | tojson }}\n{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief. ünïcode"},
            {"role": "user", "content": "  hello there  "}]


@pytest.fixture(scope="module")
def tokenizer() -> BPETokenizer:
    text = "hello there, be brief. the assistant answers the user. " * 20
    return BPETokenizer.train(text, vocab_size=300)


def test_the_template_renders_as_transformers_renders_it(tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend, bos_token="<bos>", eos_token="<eos>")
    ours = ChatTemplate.for_tokenizer(TEMPLATE, tokenizer)
    for generation_prompt in (True, False):
        expected = reference.apply_chat_template(MESSAGES, chat_template=TEMPLATE,
                                                 tokenize=False,
                                                 add_generation_prompt=generation_prompt)
        assert ours.render(MESSAGES, add_generation_prompt=generation_prompt) == expected
    with pytest.raises(ChatTemplateError, match="cannot end with a system message"):
        ours.render(MESSAGES[:1])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}", {})


def test_chat_completions_answer_what_the_rendered_prompt_generates(tokenizer) -> None:
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(vocab_size=tokenizer.vocab_size, d_model=32, n_heads=4,
                                  n_layers=2, max_len=96, dropout=0.0,
                                  positional="rope")).eval()
    rendered = ChatTemplate.for_tokenizer(TEMPLATE, tokenizer).render(MESSAGES)
    expected = generate_text(model, tokenizer, rendered, 12, temperature=0)[0]
    with serving(model, tokenizer, engine=dict(num_blocks=32, block_size=8),
                 chat_template=TEMPLATE) as url:
        async def main() -> tuple[str, str, openai.types.CompletionUsage]:
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none",
                                          max_retries=0) as client:
                plain = await client.chat.completions.create(
                    model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
                text = ""
                async for chunk in await client.chat.completions.create(
                        model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                        stream=True):
                    text += "".join(c.delta.content or "" for c in chunk.choices)
                return plain.choices[0].message.content, text, plain.usage

        plain, streamed, usage = asyncio.run(main())
        assert plain == streamed == expected
        assert usage.prompt_tokens == len(tokenizer.encode(rendered))
        refused = httpx.post(f"{url}/v1/chat/completions", json={
            "model": "tiny", "messages": MESSAGES[:1]})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"
        bad_role = httpx.post(f"{url}/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "robot", "content": "hi"}]})
        assert bad_role.status_code == 400
        assert bad_role.json()["error"]["param"] == "messages"
