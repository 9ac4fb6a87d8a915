"""A conversation (OpenAI-style messages) laid out after the cached documents.

The cache ends inside an open user turn: [template prefix][documents] (prefill/documents.py). A
conversation continues it. With a chat template, the whole conversation is rendered by the
model's own template with a placeholder standing for the documents:

    messages [user: Q]                 →  [user: DOCS + "\\n\\n" + Q]               (what `topk chat` asks)
    messages [system: S, user: Q, ...] →  [user: DOCS, system: S, user: Q, ...]

and the text after the placeholder is what is decoded after the cache. The text before it must be
the cached prefix exactly (checked), so nothing is spliced by hand. A system message cannot go in
front of the documents without prefilling again (its tokens would precede, and shift, every
cached one), so it opens its own turn right after them, as the template renders a system turn
there. Without a chat template (kind "raw") the layout is the plain-text one `topk chat` uses:
a system message is a line of its own before the first question.
"""

from __future__ import annotations

from topk_decode.errors import TopkError
from topk_decode.prefill.documents import RAW_QUESTION, PromptFormat

_DOCS = "\x00TOPKDOCS\x00"
ROLES = ("system", "developer", "user", "assistant")


def _check(messages: list[dict]) -> list[tuple[str, str]]:
    """(role, content) pairs; 'developer' is OpenAI's newer name for 'system'."""
    if not messages:
        raise TopkError("messages is empty")
    out = []
    for m in messages:
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise TopkError(f"unsupported message role {role!r} (expected one of {', '.join(ROLES)})")
        if not isinstance(content, str):
            raise TopkError(f"the content of a {role} message must be text")
        out.append(("system" if role == "developer" else role, content))
    if out[-1][0] != "user":
        raise TopkError("the last message must be the user's (the answer follows it)")
    return out


def conversation_text(messages: list[dict], fmt: PromptFormat, tokenizer) -> str:
    """The text that follows the cached documents for this conversation, up to where the answer starts.

    Args:
        messages: [{"role": "system"|"user"|"assistant"|"developer", "content": str}, ...], ending with
            a user message.
        fmt: the cache's prompt format.
        tokenizer: the model's tokenizer (its chat template renders the conversation).
    """
    pairs = _check(messages)
    if fmt.kind != "chat":
        text, asked = "", False
        for role, content in pairs:
            if role == "system":
                text += "\n" + content
            elif role == "user":
                text += ("\n" if asked else "") + RAW_QUESTION.format(question=content)
                asked = True
            else:  # the model's answers follow "Answer:" after a space, as it generates them
                text += " " + content.strip()
        return text
    if pairs[0][0] == "user":
        turns = [{"role": "user", "content": _DOCS + fmt.first + pairs[0][1]}]
        pairs = pairs[1:]
    else:
        turns = [{"role": "user", "content": _DOCS}]
    turns += [{"role": r, "content": c} for r, c in pairs]
    try:
        rendered = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - templates raise whatever they like (e.g. roles must alternate)
        raise TopkError(
            f"the model's chat template cannot render this conversation after the documents: "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None
    before, sep, after = rendered.partition(_DOCS)
    if not sep or before != fmt.prefix or _DOCS in after:
        raise TopkError(
            "the model's chat template does not place this conversation after the cached documents "
            "(e.g. it moves a system message in front of them); drop the system message"
        )
    return after
