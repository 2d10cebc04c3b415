"""How the base model leans on a pair of words in the decisions env's ``rule: word`` (docs/decisions.md).

For each pair ``a/b`` the script builds the env's own chat (system prompt, the three worked examples)
ending in "Question k of 4: Say one word: a or b." for k = 1 and 3 and both orders, and reads the
model's next-token distribution: P(a) = p(a's first token) / (p(a's) + p(b's)), and the mass p(a) + p(b)
(how often the reply is one of the two words at all). A pair suits the rule when P(a) is near 0.5 *in
either order*: a pair whose preference flips with the order (``sun/moon``: 0.23 listed first, 0.72
second) is settled by the menu's position, a channel every decision shares, which is what the word
rule exists to avoid. First-token probabilities screen pairs; the held-out evaluation measures them.

Run (repository root): ``python scripts/decisions_word_probe.py [a/b ...]`` (default: ``WORD_RULE``'s pairs).
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM

from turnrl.envs.decisions import WORD_ASK, WORD_RULE, DecisionsEnv, word_menu
from turnrl.models import embedded_model_dir, load_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pairs", nargs="*", help="word pairs a/b (a: the word that would be right)")
    args = ap.parse_args()
    pairs = [tuple(p.split("/")) for p in args.pairs] or [w[:2] for w in WORD_RULE]
    tok = load_tokenizer("embedded")
    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir()).eval()
    env = DecisionsEnv(DecisionsEnv.default_tasks("train")[0], rule="word", decisions=4)
    chat = env.initial_messages()[:-1]  # the system prompt and the worked examples

    def share(question: str, a: str, b: str) -> tuple[float, float]:
        ids = tok.apply_chat_template(
            [*chat, {"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt"
        )
        ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
        with torch.no_grad():
            probs = model(ids).logits[0, -1].softmax(-1)
        pa, pb = probs[tok.encode(a)[0]].item(), probs[tok.encode(b)[0]].item()
        return pa / (pa + pb), pa + pb

    print("pair: P(a) mean | mass | P(a) at (q1 a-first, q1 b-first, q3 a-first, q3 b-first)")
    for a, b in pairs:
        got = [
            share(f"Now the quiz. Question {k} of 4: {WORD_ASK} {word_menu(order)}.", a, b)
            for k in (1, 3)
            for order in ((a, b), (b, a))
        ]
        shares = [round(x, 2) for x, _ in got]
        print(f"{a}/{b}: {sum(shares) / 4:.2f} | {sum(m for _, m in got) / 4:.2f} | {shares}")


if __name__ == "__main__":
    main()
