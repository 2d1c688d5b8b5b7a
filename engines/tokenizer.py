"""Gyre's tokenizer: a small byte-level BPE trained, deterministically, on a corpus generated here.

Nothing is downloaded: the corpus is produced from a fixed seed and looks like what Gyre's example agents say
(English, numbers and arithmetic, JSON tool calls and tool schemas, file names, shell and Python snippets, the chat
template's markup), so agent conversations are short in tokens even though the vocabulary is ~2k. Byte-level BPE
can encode any text, so an unusual input is only longer, never an error.

The pre-tokenizer is Qwen2's split (digits one by one, which suits arithmetic) followed by byte-level mapping; the
special tokens are Qwen's names. The same tokenizer serves every preset and every seed: only weights depend on the
seed. `tokenizers`' BPE trainer is deterministic for a fixed corpus (merges are ranked by count, ties by pair ids,
and ids follow the sorted alphabet), and a test builds it twice and compares the JSON.
"""

from __future__ import annotations

import functools
import json
import random
import re
from pathlib import Path
from typing import Iterator

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from gyre.engines.chat_template import CHAT_TEMPLATE, END_OF_TEXT, IM_END, IM_START, compile_template

__all__ = [
    "MARKUP_TOKENS", "SPECIAL_TOKENS", "VOCAB_SIZE", "build_tokenizer", "corpus", "tokenizer_config",
    "write_tokenizer_files",
]

# Turn markup is special (skipped by decode(skip_special_tokens=True)); tool-call markup is an ordinary added
# token (one id each, but kept in decoded text so that tool calls can be parsed from it), as in Qwen.
SPECIAL_TOKENS: tuple[str, ...] = (END_OF_TEXT, IM_START, IM_END)
MARKUP_TOKENS: tuple[str, ...] = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
VOCAB_SIZE = 2048
"""Total ids including the added tokens; presets use it as the model's vocab_size."""
MODEL_MAX_LENGTH = 32768
CORPUS_SEED = 20240917
CORPUS_SAMPLES = 3000

_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_WORDS = """
the of and to a in is it you that he was for on are with as I his they be at one have this from or had by not word
but what some we can out other were all there when up use your how said an each she which do their time if will way
about many then them write would like so these her long make thing see him two has look more day could go come did
number sound no most people my over know water than call first who may down side been now find any new work part
take get place made live where after back little only round man year came show every good me give our under name
very through just form sentence great think say help low line differ turn cause much mean before move right boy old
too same tell does set three want air well also play small end put home read hand port large spell add even land
here must big high such follow act why ask men change went light kind off need house picture try us again animal
point mother world near build self earth father head stand own page should country found answer school grow study
still learn plant cover food sun four between state keep eye never last let thought city tree cross farm hard start
might story saw far sea draw left late run don't while press close night real life few north open seem together next
white children begin got walk example ease paper group always music those both mark often letter until mile river car
feet care second book carry took science eat room friend began idea fish mountain stop once base hear horse cut sure
watch color face wood main enough plain girl usual young ready above ever red list though feel talk bird soon body dog
family direct pose leave song measure door product black short numeral class wind question happen complete ship area
half rock order fire south problem piece told knew pass since top whole king space heard best hour better true during
hundred five remember step early hold west ground interest reach fast verb sing listen six table travel less morning
ten simple several vowel toward war lay against pattern slow center love person money serve appear road map rain rule
govern pull cold notice voice unit power town fine certain fly fall lead cry dark machine note wait plan figure star
box noun field rest correct able pound done beauty drive stood contain front teach week final gave green oh quick
develop ocean warm free minute strong special mind behind clear tail produce fact street inch multiply nothing course
stay wheel full force blue object decide surface deep moon island foot system busy test record boat common gold
possible plane stead dry wonder laugh thousand ago ran check game shape equal hot miss brought heat snow tire bring yes
distant fill east paint language among file files function functions value values result results error errors task
tasks tool tools call calls return returns argument arguments string integer boolean number numbers sum product total
compute calculate calculator expression evaluate answer answers solve solved question questions input output code
program script command commands run running ran directory directories folder path paths line lines content contents
text search find found replace edit write wrote read reading list listing create delete remove move copy update fix
fixed bug bugs test tests passed failed failure success successful module package import class method variable
variables data json key keys object array field fields user assistant system message messages response request
please thanks thank sure okay done let me now next first then finally step steps check checking looks seems correct
incorrect wrong right expected actual got should could would will can cannot need needs using used use via into onto
""".split()

_TOOL_NAMES = (
    "calculator", "read_file", "write_file", "edit_file", "list_dir", "run_command", "bash", "python", "search",
    "grep", "find_files", "submit", "finish", "get_weather", "lookup", "add", "multiply", "subtract", "divide",
)
_ARG_KEYS = (
    "expression", "path", "content", "command", "query", "pattern", "code", "answer", "a", "b", "x", "y", "city",
    "old", "new", "line", "timeout", "recursive", "name", "value", "text",
)
_EXTS = ("py", "md", "txt", "json", "toml", "yaml", "sh", "c", "h", "rs", "js", "ts", "csv", "log", "cfg")
_DIRS = ("src", "tests", "docs", "lib", "app", "scripts", "data", "utils", "core", "build", "tmp", "examples")
_SHELL = (
    "ls -la", "cat {f}", "python {f}", "python -m pytest -q", "git status", "git diff", "grep -rn {w} {d}",
    "mkdir -p {d}", "rm -f {f}", "echo {w}", "pwd", "cd {d}", "head -n 20 {f}", "wc -l {f}", "pip install -e .",
    "make test", "find . -name '*.{e}'", "sed -n '1,40p' {f}",
)
_PY = (
    "def {w}({v}):\n    return {v} + {n}\n",
    "import {w}\nfrom {w} import {v}\n",
    "for {v} in range({n}):\n    print({v})\n",
    "if {v} == {n}:\n    raise ValueError('{w}')\n",
    "class {W}:\n    def __init__(self, {v}):\n        self.{v} = {v}\n",
    "assert {w}({n}) == {m}\n",
    "with open('{f}') as f:\n    data = f.read()\n",
    "{v} = [{n}, {m}]\nprint(sum({v}))\n",
)
_ERRORS = (
    "Traceback (most recent call last):\n  File \"{f}\", line {n}, in <module>\n{E}: {w}\n",
    "Error: {w} not found", "FAILED {f}::test_{w} - AssertionError", "{n} passed, {m} failed in 0.{n}s",
    "No such file or directory: '{f}'", "Permission denied", "SyntaxError: invalid syntax", "OK",
)
_EXCEPTIONS = ("ValueError", "KeyError", "TypeError", "AssertionError", "IndexError", "RuntimeError", "NameError")


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 14))]
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice((".", ".", "?", "!", ":", ","))


def _number(rng: random.Random) -> str:
    return str(rng.choice((rng.randint(0, 9), rng.randint(10, 99), rng.randint(100, 9999), rng.randint(0, 10**7))))


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 999), rng.randint(1, 999)
    op = rng.choice("+-*/")
    value = {"+": a + b, "-": a - b, "*": a * b, "/": round(a / b, 4)}[op]
    form = rng.choice(("{a} {op} {b} = {v}", "What is {a} {op} {b}?", "{a}{op}{b}", "The answer is {v}."))
    return form.format(a=a, b=b, op=op, v=value)


def _filename(rng: random.Random) -> str:
    parts = [rng.choice(_DIRS) for _ in range(rng.randint(0, 2))]
    stem = "_".join(rng.choice(_WORDS).replace("'", "") for _ in range(rng.randint(1, 2)))
    if rng.random() < 0.3:
        stem = "test_" + stem
    return "/".join([*parts, f"{stem}.{rng.choice(_EXTS)}"])


def _fill(template: str, rng: random.Random) -> str:
    word = rng.choice(_WORDS).replace("'", "")
    return template.format(
        f=_filename(rng), d=rng.choice(_DIRS), w=word, W=word.capitalize(), v=rng.choice("xyzijkn") + rng.choice(
            ("", "s", "_" + rng.choice(_WORDS).replace("'", ""))
        ), n=rng.randint(0, 99), m=rng.randint(0, 999), e=rng.choice(_EXTS), E=rng.choice(_EXCEPTIONS),
    )


def _arguments(rng: random.Random) -> dict:
    arguments = {}
    for key in rng.sample(_ARG_KEYS, rng.randint(1, 3)):
        kind = rng.random()
        if kind < 0.3:
            arguments[key] = _arithmetic(rng).split(" =")[0]
        elif kind < 0.5:
            arguments[key] = _filename(rng)
        elif kind < 0.7:
            arguments[key] = rng.randint(0, 9999)
        elif kind < 0.8:
            arguments[key] = rng.choice((True, False))
        else:
            arguments[key] = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 4)))
    return arguments


def _tool_schema(rng: random.Random) -> dict:
    keys = rng.sample(_ARG_KEYS, rng.randint(1, 3))
    return {
        "type": "function",
        "function": {
            "name": rng.choice(_TOOL_NAMES),
            "description": _sentence(rng),
            "parameters": {
                "type": "object",
                "properties": {k: {"type": rng.choice(("string", "integer", "number", "boolean")),
                                   "description": _sentence(rng)} for k in keys},
                "required": keys[:1],
            },
        },
    }


def _free_text(rng: random.Random) -> str:
    pieces = []
    for _ in range(rng.randint(1, 4)):
        kind = rng.random()
        if kind < 0.35:
            pieces.append(_sentence(rng))
        elif kind < 0.55:
            pieces.append(_arithmetic(rng))
        elif kind < 0.65:
            pieces.append(_filename(rng))
        elif kind < 0.75:
            pieces.append(_fill(rng.choice(_SHELL), rng))
        elif kind < 0.88:
            pieces.append(_fill(rng.choice(_PY), rng))
        elif kind < 0.95:
            pieces.append(_fill(rng.choice(_ERRORS), rng))
        else:
            pieces.append(_number(rng))
    return rng.choice((" ", "\n", "\n\n")).join(pieces)


def _conversation(rng: random.Random) -> tuple[list[dict], list[dict] | None]:
    tools = [_tool_schema(rng) for _ in range(rng.randint(1, 3))] if rng.random() < 0.5 else None
    messages: list[dict] = []
    if rng.random() < 0.6:
        messages.append({"role": "system", "content": _sentence(rng)})
    for _ in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": _free_text(rng)})
        if rng.random() < 0.5:
            calls = [
                {"type": "function", "function": {"name": rng.choice(_TOOL_NAMES),
                                                  "arguments": json.dumps(_arguments(rng), ensure_ascii=False)}}
                for _ in range(rng.randint(1, 2))
            ]
            messages.append({"role": "assistant", "content": _sentence(rng) if rng.random() < 0.4 else "",
                             "tool_calls": calls})
            for _ in calls:
                messages.append({"role": "tool", "content": _free_text(rng)})
        messages.append({"role": "assistant", "content": _free_text(rng)})
    return messages, tools


def corpus(seed: int = CORPUS_SEED, samples: int = CORPUS_SAMPLES) -> Iterator[str]:
    """The generated training text: rendered chat conversations (markup, tools, tool calls) and free text."""
    rng = random.Random(seed)
    template = compile_template(CHAT_TEMPLATE)
    for _ in range(samples):
        if rng.random() < 0.6:
            messages, tools = _conversation(rng)
            yield template.render(messages=messages, tools=tools, add_generation_prompt=False)
        else:
            yield _free_text(rng)


_SPLIT_ADDED = re.compile("|".join(re.escape(t) for t in (*SPECIAL_TOKENS, *MARKUP_TOKENS)))


def _without_added_tokens(texts: Iterator[str]) -> Iterator[str]:
    # The trainer does not split on added tokens: feeding "<|im_start|>" would waste merges on its pieces.
    for text in texts:
        yield from (piece for piece in _SPLIT_ADDED.split(text) if piece)


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False)
    added = len(SPECIAL_TOKENS) + len(MARKUP_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - added,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(_without_added_tokens(corpus()), trainer=trainer)
    # Added after training so that they take the top ids, as in Qwen (BPE ids stay those the trainer assigned).
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    if tokenizer.get_vocab_size(with_added_tokens=True) > VOCAB_SIZE:
        raise RuntimeError("the trained tokenizer is larger than VOCAB_SIZE")  # a bug here, not bad input
    return tokenizer.to_str()


def build_tokenizer() -> Tokenizer:
    """The trained tokenizer (built once per process, about a second)."""
    return Tokenizer.from_str(_tokenizer_json())


def tokenizer_config(chat_template: str = CHAT_TEMPLATE) -> dict:
    """tokenizer_config.json: what transformers' AutoTokenizer needs besides tokenizer.json."""
    tokenizer = build_tokenizer()
    decoder = {}
    for token in (*SPECIAL_TOKENS, *MARKUP_TOKENS):
        decoder[str(tokenizer.token_to_id(token))] = {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": token in SPECIAL_TOKENS,
        }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
        "unk_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "errors": "replace",
        "split_special_tokens": False,
    }


def write_tokenizer_files(model_dir: str | Path, chat_template: str = CHAT_TEMPLATE) -> None:
    """Write tokenizer.json and tokenizer_config.json into `model_dir` (which must exist)."""
    model_dir = Path(model_dir)
    (model_dir / "tokenizer.json").write_text(_tokenizer_json(), encoding="utf-8")
    config = tokenizer_config(chat_template)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                     encoding="utf-8")
