"""Finding the model's code in a reply (fenced blocks or bare code)."""

from __future__ import annotations

import re

_FENCE = "```"
_LANG = re.compile(r"[ \t]*([A-Za-z0-9_+.-]*)")
_CODE_START = re.compile(r"^(?:def |class |import |from |@|[A-Za-z_][A-Za-z0-9_, ]*=)")


def _defines(code: str, name: str) -> bool:
    return re.search(rf"^[ \t]*(?:async[ \t]+)?def[ \t]+{name}[ \t]*\(|^{name}[ \t]*=", code, re.M) is not None


def _compiles(code: str) -> bool:
    try:
        compile(code, "<extract>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError, SystemError):
        # SystemError: CPython 3.11's compiler can report deeply nested input as "AST constructor
        # recursion depth mismatch" instead of RecursionError, depending on the caller's stack depth
        return False
    return True


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced block: a fence, its info line (the language first), the body up
    to the next fence or the end of the text.

    Linear time by construction: one left-to-right scan with ``str.find``, each search starting where
    the previous one ended; the language is matched at the start of one info line only. (The regular
    expression this replaces, retried from every fence of a text without a newline, was quadratic in
    a reply of ``"```" * n``.) A fence with no newline after it opens no block, nor does any later one.
    """
    blocks: list[tuple[str, str]] = []
    pos = 0
    while (start := text.find(_FENCE, pos)) != -1:
        info = start + len(_FENCE)
        newline = text.find("\n", info)
        if newline == -1:
            break
        lang = _LANG.match(text, info, newline)
        end = text.find(_FENCE, newline + 1)
        end = len(text) if end == -1 else end
        blocks.append((lang.group(1) if lang else "", text[newline + 1 : end]))
        pos = end + len(_FENCE)
    return blocks


def has_code(text: str) -> bool:
    return "```" in text or re.search(r"^(?:def |import |from )", text, re.M) is not None


def extract_code(text: str, name: str) -> str | None:
    """The Python code in a reply that defines ``name`` (``main`` or ``policy``), or None.

    If the reply has fences, only Python blocks (```python, ```py or bare ```)
    count: the last block that defines ``name``, preceded by the earlier Python
    blocks (helpers) when the whole still compiles. Without fences, the reply
    itself, from its first code-looking line, trimmed of trailing prose until it
    compiles. Code that defines ``name`` but does not compile is returned as is
    (it fails in the sandbox with a SyntaxError).
    """
    if "```" in text:
        blocks = [body for lang, body in fenced_blocks(text) if lang.lower() in ("", "python", "py", "python3")]
        hits = [i for i, b in enumerate(blocks) if _defines(b, name)]
        if not hits:
            return None
        last = hits[-1]
        joined = "\n\n".join(b.rstrip() for b in blocks[: last + 1]) + "\n"
        if _compiles(joined) or not _compiles(blocks[last]):
            return joined if last else blocks[last]
        return blocks[last]
    if not _defines(text, name):
        return None
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if _CODE_START.match(line)), 0)
    body = lines[start:]
    for end in range(len(body), max(0, len(body) - 200), -1):
        candidate = "\n".join(body[:end]) + "\n"
        if _defines(candidate, name) and _compiles(candidate):
            return candidate
    return "\n".join(body) + "\n"
