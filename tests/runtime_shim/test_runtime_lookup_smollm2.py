"""Prompt-lookup decoding on the real model: SmolLM2-135M-Instruct rewriting a paragraph
of the evaluation text gives token for token the greedy output of plain decoding (int4
and f32 with the float cache), with most drafts accepted, also when a stop string or
``max_tokens`` ends the text inside a draft."""

from __future__ import annotations

from pathlib import Path

import pytest
from runtime_fixtures import eval_text, smollm2_package

import edgepack.runtime_shim as rt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.getbasetemp() / "smollm2-runtime"
    d.mkdir(exist_ok=True)
    return d


def _rewrite_prompt(model: rt.Model) -> list[int]:
    paragraph = next(p for p in eval_text().split("\n\n") if p.startswith("If a name binding"))
    s = model.session()
    text = s.render_chat([{"role": "user", "content": f"Rewrite this paragraph:\n\n{paragraph}"}])
    s.close()
    return model.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(("encoding", "kv"), [("int4-g32", "int8"), ("f32", "float")])
def test_rewrite_is_identical_with_lookup(smollm2_gguf: Path, root: Path, encoding, kv) -> None:
    pkg = smollm2_package(smollm2_gguf, root, encoding)
    with rt.open(pkg, kv=kv, kernels="native", verify="none") as m:
        prompt = _rewrite_prompt(m)
        plain = m.session()
        want = list(plain.generate(prompt, 96, lookup=False))
        for lookup in (True, "auto"):
            s = m.session()
            assert list(s.generate(prompt, 96, lookup=lookup)) == want
            assert s.tokens == plain.tokens
        st = s.stats
        assert st.lookup == "auto"
        assert st.accepted_tokens > 0
        # the bounds inside drafts: a few max_tokens and a stop string mid text
        with m.session() as s:
            for n in (7, 23, 41):
                assert list(s.generate(prompt, n, lookup=True)) == want[:n]
        text = m.tokenizer.decode(want)
        stop = text[len(text) // 2 : len(text) // 2 + 6]
        cut = "".join(m.session().generate(prompt, 96, output="text", stop=stop, lookup=False))
        looked = m.session()
        assert "".join(looked.generate(prompt, 96, output="text", stop=stop, lookup=True)) == cut
        assert looked.stats.finish_reason == "stop"
