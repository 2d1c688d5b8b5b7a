"""The chat template of Gyre's models, and a per-message renderer that agrees with it token for token.

The proxy never re-tokenizes a conversation: it keeps the ids of every message it has already seen or generated
and appends only the new messages' ids. That only works if rendering the whole conversation equals concatenating
per-message renderings. This template guarantees it by construction: every turn begins with the special token
`<|im_start|>` and ends with `<|im_end|>\\n`, and the tokenizer splits on special tokens before it applies BPE, so
no BPE merge can cross a turn boundary. `ChatTemplate` renders single turns through the very same Jinja template
(with the same environment settings as transformers' `apply_chat_template`), so there is one source of truth for
the markup; the tests compare the two paths against transformers on varied conversations.

Rendering through Jinja costs more than tokenising (a sandboxed context per call): on the proxy's hot path that was
the biggest single cost of a call. So for Gyre's own template (`CHAT_TEMPLATE`, compared by source text) a
pure-Python renderer, `render_builtin_text`, writes the same text for the shapes agents send (plain system, user
and tool messages, assistant messages with tool calls, tools given as dicts); anything else (an unusual type, a
missing field, a template a checkpoint brought) goes through Jinja. A property test holds the two to the same text
on generated conversations.

A template a checkpoint brings (any other source) renders through Jinja exactly as apply_chat_template does
(tests/unit/engines/test_hf_templates.py), but is not assumed decomposable (`decomposable` is false): per-message
renders are not its renders (a default system prompt, a BOS at the start only, Qwen3 dropping earlier `<think>`
blocks). The proxy renders such a conversation whole and tokenises only what is new, cutting texts after special
tokens (`encode_with_cuts`, `splits_at_special_tokens`); see actors/serving/sessions.py. Its stop tokens add the
tokenizer config's eos_token (Llama's `<|eot_id|>`) to `<|im_end|>` and `<|endoftext|>` where the tokenizer has them.

Layout (Qwen style):

    <|im_start|>system\\n{system text}[\\n\\n]{tools section}<|im_end|>\\n      (only if a system text or tools)
    <|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n{content}[\\n]<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call><|im_end|>\\n
    <|im_start|>tool\\n<tool_response>\\n{content}\\n</tool_response><|im_end|>\\n

Several tool calls are separated by "\\n"; a "\\n" separates non-empty content from the first call. A tool call's
`arguments` string is inserted verbatim (it is what the model emitted); a dict is rendered with json.dumps's
default separators and ensure_ascii=False, the same text `gyre.engines.tool_calls` parses. Each tool result is its
own turn (unlike Qwen, which groups consecutive tool results into one user turn) so that a message's ids never
depend on its neighbours.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from gyre.engines.errors import ChatTemplateError

__all__ = ["CHAT_TEMPLATE", "ChatTemplate", "ChatTemplateError", "compile_template", "render_builtin_text"]

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"

# The tools section is compact on purpose: one line per tool, `name(arg, ...): description`. Full JSON schemas
# cost a small model hundreds of context tokens per call that carry no loss and teach nothing; checkpoints that
# bring their own template (any Qwen3) keep theirs.
TOOLS_PREAMBLE = "Tools:"
TOOLS_EPILOGUE = '\nCall a tool as <tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>'

# Whitespace matters: transformers compiles templates with trim_blocks and lstrip_blocks, and every piece of
# output below is an explicit `{{- ... }}` string so that the layout of this source never leaks into the text.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(start=0) %}\n"
    "{%- if messages and messages[0].role == 'system' %}{%- set ns.start = 1 %}{%- endif %}\n"
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if ns.start == 1 and messages[0].content %}{{- messages[0].content + '\\n\\n' }}{%- endif %}\n"
    "    {{- " + json.dumps(TOOLS_PREAMBLE) + " }}\n"
    "    {%- for tool in tools %}{%- set f = tool.function if tool.function is defined else tool %}\n"
    "        {%- set p = f.parameters.properties if (f.parameters is defined and f.parameters.properties is defined)"
    " else {} %}\n"
    "        {{- '\\n' + f.name + '(' + (p | list | join(', ')) + ')' }}\n"
    "        {%- if f.description %}{{- ': ' + f.description }}{%- endif %}\n"
    "    {%- endfor %}\n"
    "    {{- " + json.dumps(TOOLS_EPILOGUE) + " + '<|im_end|>\\n' }}\n"
    "{%- elif ns.start == 1 %}\n"
    "    {{- '<|im_start|>system\\n' + (messages[0].content or '') + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if loop.index0 < ns.start %}\n"
    "    {%- elif message.role == 'user' or message.role == 'system' %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == 'assistant' %}\n"
    "        {{- '<|im_start|>assistant\\n' + (message.content or '') }}\n"
    "        {%- for tool_call in (message.tool_calls or []) %}\n"
    "            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}\n"
    "            {%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}\n"
    "            {{- '<tool_call>\\n{\"name\": ' + (tool_call.name | tojson) + ', \"arguments\": ' }}\n"
    "            {%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == 'tool' %}\n"
    "        {{- '<|im_start|>tool\\n<tool_response>\\n' + (message.content or '')"
    " + '\\n</tool_response><|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- raise_exception('unknown message role: ' + (message.role | string)) }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)

_ROLES = ("system", "user", "assistant", "tool")
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
"""tokenizer_config.json entries that transformers hands to chat templates as variables."""


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
    # Same filter as transformers installs: Jinja's own tojson escapes HTML characters.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class _GenerationBlocks(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers' mark of the text a model generates (it reads the marks
    for `return_assistant_tokens_mask`), which templates on the Hub carry. Rendered as its body, in a scope of its
    own as transformers' call block has (a `set` inside does not leak out); without the tag such templates would
    not compile. Gyre finds a turn's generated tokens by rendering prefixes instead (engines/sft.py), which needs
    no marks and agrees with them where they are (tests/integration/engines/test_sft_templates.py)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template with the settings transformers uses, so that both render the same text."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _GenerationBlocks])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _check_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """Validate one OpenAI-style message and return a plain copy the template can read."""
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"a message must be a mapping, got {type(message).__name__}")
    role = message.get("role")
    if role not in _ROLES:
        raise ChatTemplateError(f"unknown message role {role!r}; expected one of {_ROLES}")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise ChatTemplateError(f"{role} message content must be a string or None, got {type(content).__name__}")
    plain = dict(message)
    tool_calls = message.get("tool_calls")
    if tool_calls:
        if role != "assistant":
            raise ChatTemplateError(f"only assistant messages carry tool_calls, not {role}")
        for call in tool_calls:
            function = call.get("function", call) if isinstance(call, Mapping) else None
            if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
                raise ChatTemplateError(f"a tool call needs function.name as a string, got {call!r}")
            arguments = function.get("arguments")
            if not isinstance(arguments, (str, Mapping)):
                raise ChatTemplateError(f"tool call arguments must be a JSON string or a dict, got {arguments!r}")
    return plain


def _tools_text(system_text: Any, tools: Sequence[Any]) -> str | None:
    """The system turn with a tools section, as CHAT_TEMPLATE writes it; None for an unusual tool shape."""
    parts = ["<|im_start|>system\n"]
    if system_text:
        parts.append(system_text + "\n\n")
    parts.append(TOOLS_PREAMBLE)
    for tool in tools:
        if type(tool) is not dict:
            return None
        function = tool["function"] if "function" in tool else tool
        if type(function) is not dict or type(function.get("name")) is not str:
            return None
        properties: Any = {}
        if "parameters" in function:
            parameters = function["parameters"]
            if type(parameters) is not dict:
                return None
            if "properties" in parameters:
                properties = parameters["properties"]
                if type(properties) is not dict or not all(type(name) is str for name in properties):
                    return None
        parts.append("\n" + function["name"] + "(" + ", ".join(properties) + ")")
        description = function.get("description")
        if description:
            if type(description) is not str:
                return None
            parts.append(": " + description)
    parts.append(TOOLS_EPILOGUE + "<|im_end|>\n")
    return "".join(parts)


def render_builtin_text(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None, add_generation_prompt: bool
) -> str | None:
    """CHAT_TEMPLATE's text for checked messages, written in plain Python (no Jinja); None when the conversation
    has a shape this does not handle, and then the caller renders through Jinja (which also raises the errors).

    Handled: messages whose role is system/user/assistant/tool and whose content is a str or None; assistant tool
    calls as dicts (with or without a "function" wrapper) whose name is a str and arguments a str (verbatim) or a
    dict (json.dumps, ensure_ascii=False, as the template's tojson); tools as dicts whose parameters/properties are
    dicts with str keys and whose description is a str or empty. Exact types are required (no subclasses): this
    is a fast path, not a second template engine.
    """
    parts: list[str] = []
    start = 1 if messages and messages[0].get("role") == "system" else 0
    if tools:
        tools_text = _tools_text(messages[0].get("content") if start else None, tools)
        if tools_text is None:
            return None
        parts.append(tools_text)
    elif start:
        parts.append("<|im_start|>system\n" + (messages[0].get("content") or "") + "<|im_end|>\n")
    for message in messages[start:]:
        role = message.get("role")
        raw_content = message.get("content")
        if raw_content is not None and type(raw_content) is not str:
            return None
        content = raw_content or ""
        if role == "user" or role == "system":
            parts.append("<|im_start|>" + role + "\n" + content + "<|im_end|>\n")
        elif role == "assistant":
            parts.append("<|im_start|>assistant\n" + content)
            calls = message.get("tool_calls") or ()
            if type(calls) is not list and type(calls) is not tuple:
                return None
            for index, call in enumerate(calls):
                if type(call) is not dict:
                    return None
                function = call["function"] if "function" in call else call
                if type(function) is not dict or type(function.get("name")) is not str:
                    return None
                arguments = function.get("arguments")
                if type(arguments) is dict:
                    arguments = json.dumps(arguments, ensure_ascii=False)
                elif type(arguments) is not str:
                    return None
                if content or index:
                    parts.append("\n")
                parts.append(
                    '<tool_call>\n{"name": ' + json.dumps(function["name"], ensure_ascii=False)
                    + ', "arguments": ' + arguments + "}\n</tool_call>"
                )
            parts.append("<|im_end|>\n")
        elif role == "tool":
            parts.append("<|im_start|>tool\n<tool_response>\n" + content + "\n</tool_response><|im_end|>\n")
        else:
            return None
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


ENCODE_WITHOUT_GIL_CHARS = 16384
"""Texts at least this long are tokenised with the GIL released (below it, encode_batch's overhead is not worth it)."""


class ChatTemplate:
    """Renders conversations to token ids, whole or one message at a time, with identical results.

    `tokenizer` is a `tokenizers.Tokenizer` (the fast Rust one; no transformers import on the proxy's hot path).
    `fast_path` lets Gyre's own template render without Jinja (see `render_builtin_text`); it has no effect on any
    other template, and False forces Jinja everywhere (the tests compare the two).
    """

    def __init__(self, tokenizer: Tokenizer, source: str = CHAT_TEMPLATE, fast_path: bool = True,
                 special_tokens: Mapping[str, str] | None = None, eos_token_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        """Template variables such as bos_token and eos_token (tokenizer_config.json's strings): transformers
        passes them to every render, and Llama-style templates open with `{{ bos_token }}`."""
        self.decomposable = source == CHAT_TEMPLATE
        """Whether rendering a conversation equals concatenating per-message renders (Gyre's own template, by
        construction). The proxy renders any other template whole (see `turn_text_after` and
        actors/serving/sessions.py)."""
        self.fast_path = fast_path and self.decomposable
        """Whether renders try `render_builtin_text` before Jinja."""
        self._template = compile_template(source)
        ids: dict[str, int | None] = {}
        for token in (IM_START, IM_END, END_OF_TEXT):
            token_id = tokenizer.token_to_id(token)
            if token_id is None and self.decomposable:
                raise ChatTemplateError(f"the tokenizer has no {token} token")
            ids[token] = token_id
        self.im_start_id = ids[IM_START]
        self.im_end_id = ids[IM_END]
        self.end_of_text_id = ids[END_OF_TEXT]
        stops = [ids[IM_END], ids[END_OF_TEXT]]
        eos = self.special_tokens.get("eos_token")
        if eos is not None and tokenizer.token_to_id(eos) is not None:
            stops.append(tokenizer.token_to_id(eos))
        if not self.decomposable:  # generation_config.json's eos_token_id (Llama 3.1: <|eom_id|> and <|eot_id|>)
            stops.extend(i for i in eos_token_ids if tokenizer.id_to_token(i) is not None)
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in stops if i is not None))
        """Tokens that end an assistant turn: the turn end, and the end-of-text token as a fallback (and, for a
        checkpoint's template, the tokenizer config's eos_token and generation_config.json's eos_token_id: Llama's
        `<|eot_id|>` and `<|eom_id|>`, say)."""
        if not self.stop_token_ids:
            raise ChatTemplateError("the tokenizer has none of <|im_end|>, <|endoftext|> or its eos_token")
        self._header = tuple(self.encode(f"{IM_START}assistant\n"))
        self._trailer = tuple(self.encode("\n"))
        self._stop_texts = {i: tokenizer.id_to_token(i) for i in self.stop_token_ids}
        self._special_ids = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        self.splits_at_special_tokens = self._probe_special_splits()
        """Whether tokenising a text in two pieces cut right after a special token gives the ids of the whole
        (true of byte-level BPE tokenizers such as Qwen's and Llama 3's, which split on special tokens first).
        The proxy reuses ids across calls only when it holds; otherwise it tokenises each prompt whole."""

    def _probe_special_splits(self) -> bool:
        added = [t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special]
        samples = [" a\n\n b", "\n\nx y", "Hello  world", "\u00fc\u00f1 \t"]
        for token in added[:4]:
            for left in samples[:2]:
                for right in samples:
                    whole = self.encode(left + token + right)
                    if whole != self.encode(left + token) + self.encode(right):
                        return False
        return True

    def stop_text(self, token_id: int) -> str | None:
        """The text of a stop token (None for any other id)."""
        return self._stop_texts.get(token_id)

    def turn_text_after(
        self, messages: Sequence[Mapping[str, Any]], index: int, tools: Sequence[Mapping[str, Any]] | None = None,
        *, marker: str, stop_id: int | None = None,
    ) -> str | None:
        """The template's text after assistant message `index` of `messages`, generation prompt included: the
        conversation rendered with that message replaced by an assistant message whose content is `marker` (a
        random string the caller draws), and what follows the marker. None unless the marker is in the render
        exactly once (a template that rewrites assistant content, say upper-cases it, hides where the turn ends).

        `stop_id`, the last token of the generated turn: where it is a stop token it stands for the template's own
        turn end, and a leading turn end (its text, or any other stop token's) is dropped, so the prompt never gets
        two turn ends in a row (a model may end with `<|endoftext|>` where the template writes `<|im_end|>`); any
        other token (an output cut short) drops nothing. The proxy's keep_generated
        rule (actors/serving/sessions.py) and SFT's targets of a checkpoint's template (engines/sft.py) both read a
        turn's context this way. A template that refuses the conversation raises ChatTemplateError."""
        probe = [*messages[:index], {"role": "assistant", "content": marker}, *messages[index + 1 :]]
        text = self.render_text(probe, tools, True)
        at = text.find(marker)
        if at < 0 or text.find(marker, at + len(marker)) >= 0:
            return None
        after = text[at + len(marker) :]
        if stop_id is not None and self.stop_text(stop_id) is not None:
            for stop in (self.stop_text(stop_id), *(self.stop_text(i) for i in self.stop_token_ids)):
                if stop and after.startswith(stop):
                    return after[len(stop) :]
        return after

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ChatTemplate":
        """Load tokenizer.json and the template (tokenizer_config.json's chat_template, or chat_template.jinja)."""
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ChatTemplateError(f"{model_dir} has no tokenizer.json")
        source = None
        jinja_file = model_dir / "chat_template.jinja"
        config_file = model_dir / "tokenizer_config.json"
        if jinja_file.is_file():
            source = jinja_file.read_text(encoding="utf-8")
        elif config_file.is_file():
            source = json.loads(config_file.read_text(encoding="utf-8")).get("chat_template")
        if not isinstance(source, str):
            raise ChatTemplateError(f"{model_dir} has no chat template (tokenizer_config.json or chat_template.jinja)")
        special: dict[str, str] = {}
        if config_file.is_file():
            config = json.loads(config_file.read_text(encoding="utf-8"))
            for name in SPECIAL_TOKEN_NAMES:
                value = config.get(name)
                value = value.get("content") if isinstance(value, Mapping) else value  # AddedToken form
                if isinstance(value, str):
                    special[name] = value
        eos_ids: list[int] = []
        generation_file = model_dir / "generation_config.json"
        if generation_file.is_file():
            value = json.loads(generation_file.read_text(encoding="utf-8")).get("eos_token_id")
            values = value if isinstance(value, list) else [value]
            eos_ids = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
        return cls(Tokenizer.from_file(str(tokenizer_file)), source, special_tokens=special, eos_token_ids=eos_ids)

    # -- text ------------------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, special-token strings included, no BOS/EOS added (as apply_chat_template does).

        A long text goes through `encode_batch`, which releases the GIL while it tokenises (`encode` holds it), so a
        large prompt rendered on the proxy's worker thread does not stall the event loop; the ids are the same."""
        if len(text) >= ENCODE_WITHOUT_GIL_CHARS:
            return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_with_cuts(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode(text)` and, for each special token in it, (characters, ids) up to and including it: the places
        where the text may be cut and each side tokenised alone (when `splits_at_special_tokens`)."""
        if len(text) >= ENCODE_WITHOUT_GIL_CHARS:
            encoding = self.tokenizer.encode_batch([text], add_special_tokens=False)[0]
        else:
            encoding = self.tokenizer.encode(text, add_special_tokens=False)
        ids = encoding.ids
        special = self._special_ids
        cuts = [(encoding.offsets[i][1], i + 1) for i, token in enumerate(ids) if token in special]
        return ids, cuts

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The conversation's text. `template_kwargs` reach the template as variables, as in transformers'
        apply_chat_template (`enable_thinking=False` for Qwen3's templates, say)."""
        checked = [_check_message(m) for m in messages]
        if self.fast_path and not template_kwargs:
            text = render_builtin_text(checked, tools, add_generation_prompt)
            if text is not None:
                return text
        try:
            return self._template.render(
                **self.special_tokens, **template_kwargs,
                messages=checked, tools=list(tools) if tools else None, add_generation_prompt=add_generation_prompt,
            )
        except (jinja2.exceptions.TemplateError, TypeError) as error:
            # TypeError: data the template cannot combine (a tool description that is a number, say).
            raise ChatTemplateError(str(error)) from error

    # -- ids -------------------------------------------------------------------------------------------------

    def render_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """The whole conversation's ids; equals transformers' apply_chat_template on the same model directory."""
        return self.encode(self.render_text(messages, tools, add_generation_prompt, **template_kwargs))

    def system_ids(self, tools: Sequence[Mapping[str, Any]] | None = None, system_text: str | None = None) -> list[int]:
        """The system turn (empty when there is neither a system text nor tools)."""
        messages = [] if system_text is None else [{"role": "system", "content": system_text}]
        return self.render_ids(messages, tools, add_generation_prompt=False)

    def message_ids(self, message: Mapping[str, Any]) -> list[int]:
        """One user, assistant or tool turn (a system message here renders as a plain system turn, without tools)."""
        return self.render_ids([message], None, add_generation_prompt=False)

    def conversation_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[list[int]]:
        """The per-piece ids whose concatenation is `render_ids(...)`: system part, one list per non-system
        message, then the generation prompt (empty lists are kept so indices stay predictable). Only for a
        decomposable template: a checkpoint's own template raises ChatTemplateError (its per-piece renders are not
        its render; use `render_ids`)."""
        if not self.decomposable:
            raise ChatTemplateError(
                "this chat template is not decomposable per message (a checkpoint's own template): per-piece renders "
                "would not be its render; render the conversation whole (render_ids)"
            )
        messages = list(messages)
        system_text = None
        if messages and messages[0].get("role") == "system":
            system_text = messages[0].get("content") or ""
            messages = messages[1:]
        pieces = [self.system_ids(tools, system_text)]
        pieces.extend(self.message_ids(m) for m in messages)
        pieces.append(self.generation_prompt_ids() if add_generation_prompt else [])
        return pieces

    def assistant_header_ids(self) -> list[int]:
        """`<|im_start|>assistant\\n`: what precedes the model's output in an assistant turn."""
        return list(self._header)

    def assistant_trailer_ids(self) -> list[int]:
        """What follows `<|im_end|>` in a rendered assistant turn ("\\n")."""
        return list(self._trailer)

    def generation_prompt_ids(self) -> list[int]:
        return list(self._header)

    def assistant_turn_ids(self, output_ids: Sequence[int]) -> list[int]:
        """The ids of an assistant turn whose body the model generated: header + output + trailer, reusing the
        output verbatim. An output cut short (no final `<|im_end|>`) gets one, as rendering its text would; an
        output ending with `<|endoftext|>` has it replaced, because the rendered turn always ends `<|im_end|>`."""
        body = list(output_ids)
        if body and body[-1] == self.end_of_text_id:
            body = body[:-1]
        if not body or body[-1] != self.im_end_id:
            body.append(self.im_end_id)
        return [*self._header, *body, *self._trailer]

    def assistant_body_ids(self, turn_ids: Sequence[int]) -> list[int]:
        """The inverse of `assistant_turn_ids`: the ids between header and trailer (ending with `<|im_end|>`).

        A turn rendered from text whose content starts with whitespace up to a newline does not split at the
        header (BPE merges the header's "\n" into the content's newlines) and raises ChatTemplateError; a
        generated turn always splits, which is why the proxy keeps generated ids instead of re-rendering."""
        header, trailer = self._header, self._trailer
        turn = list(turn_ids)
        if tuple(turn[: len(header)]) != header or tuple(turn[len(turn) - len(trailer) :]) != trailer:
            raise ChatTemplateError("not an assistant turn: header or trailer missing")
        return turn[len(header) : len(turn) - len(trailer)]
