#!/usr/bin/env python3
"""Generates the tokenizer reference data committed under tests/model/data/ (run once; the C
tests never call Python):

  tokenizer_smollm2.txt  expected token ids for SmolLM2's tokenizer, one case per line
  tokenizer_chat.txt     chat templates and what jinja2 renders from them

Reference used: the HF `tokenizers` library (PyPI `tokenizers`), with a byte-level BPE built
from the GGUF's own vocab and merges (gguf.GGUFReader) and set up the way SmolLM2's
tokenizer.json is: no normalizer; pre-tokenizers Digits(individual_digits=True) then
ByteLevel(add_prefix_space=False, use_regex=True); BPE without unk token or byte fallback; the
CONTROL tokens (token_type 3) added as special tokens. For cases with parse_special off the same
model is used without the added tokens. Chat renderings come from jinja2 (PyPI `jinja2`)
rendering the template strings, one of which is the GGUF's tokenizer.chat_template.

Usage: python3 scripts/gen_tokenizer_cases.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]
"""
import os
import pathlib
import sys
import unicodedata

import jinja2
from gguf import GGUFReader
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

CONTROL = 3

CASES = [
    # (parse_special, text)
    (1, ""),
    (1, "Hello world"),
    (1, "Hello, world! How are you today?"),
    (1, "The quick brown fox jumps over the lazy dog."),
    (1, " leading space"),
    (1, "trailing space "),
    (1, "   three leading spaces"),
    (1, "multiple    spaces   between  words"),
    (1, " "),
    (1, "     "),
    (1, "line one\nline two\n\nline four"),
    (1, "\ttabbed\tcolumns\t\tend\t"),
    (1, "\n\n\n"),
    (1, "a  \n  b \t c\r\nd"),
    (1, "ends with a newline\n"),
    (1, "   \n"),
    (1, "12345"),
    (1, "Call 555-0123 or pay 1,000,000.50 now"),
    (1, "3.14159265358979323846264338327950288419716939937510"),
    (1, "year 2024: 42 apples, 7 pears"),
    (1, "!!! ??? ... --- *** ///"),
    (1, "Wait... what?!?! (really) [yes] {no} <maybe> ==>"),
    (1, "don't can't won't it's I'm you're we've they'll he'd"),
    (1, "DON'T IT'S YOU'RE 'S 'tis 'll ''"),
    (1, "def foo(x):\n    return x * 2  # double it\n"),
    (1, "int main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n"),
    (1, '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}'),
    (1, "https://example.com/path/to?query=1&x=y#frag"),
    (1, "email@example.com, $100.00, 50% off, #hashtag @mention ~tilde"),
    (1, "# Title\n\n- item 1\n- item 2\n\n**bold** _italic_ `code`"),
    (1, "naïve café résumé über Ångström"),
    (1, "日本語のテキストです。"),
    (1, "中文测试，你好世界！"),
    (1, "안녕하세요 세계"),
    (1, "Ελληνικά και русский текст"),
    (1, "مرحبا بالعالم"),
    (1, "नमस्ते दुनिया"),
    (1, "Emoji: 😀🎉👍🏽 and 🇫🇷 flags ❤️"),
    (1, "mixed١٢٣ digits ³ ½ Ⅷ ２０２４"),
    (1, "a\u00a0b\u3000c\u2028d\u0085e  \u00a0 f"),
    (1, "zero\u200bwidth\ufeffmarks\u001cx"),
    # Letters and digits assigned in Unicode 15 and 16 (the regex engine's tables are 16.0).
    (1, "new \U00011f04\U00011f05's \ua7da't \U00013460'd \U0001ccf0\U0001ccf1 \U0001e4f0"),
    (1, "supercalifragilisticexpialidocious antidisestablishmentarianism"),
    (1, "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"),
    (1, "================================================== ----------"),
    (1, "ALL CAPS SHOUTING AND MiXeD cAsE"),
    (1, "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"),
    (0, "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"),
    (1, "<|endoftext|>"),
    (1, "text<|im_end|>more<|im_start|><|im_end|> spaced <|endoftext|> "),
    (1, "<repo_name>kvstage<file_sep>README.md<filename>x.c<gh_stars>10"),
    (1, "<|im_start partial <|im_end| and <|unknown|>"),
    (0, "<|endoftext|> and <reponame>"),
    (1, "control\x04\x06 bytes\x13\x14\x16\x1d dropped"),
]

CHAT_CONVERSATIONS = [
    [("user", "Hello!")],
    [("system", "You are terse."), ("user", "What is the capital of France?")],
    [("user", "What is 2+2?"), ("assistant", "4"), ("user", "And times 3?")],
    [("system", "Answer in French."), ("user", "Hi"), ("assistant", "Bonjour !")],
    [("assistant", "I start."), ("user", "Multi\nline\n\ncontent with <|im_end|> inside")],
]

PLAIN_CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The SmolLM2 template re-laid out with whitespace control and escaped newlines: renders the
# same, so a recogniser that is not a plain string compare must accept it.
TRIMMED_SMOLLM2 = """{%- for message in messages -%}
    {%- if loop.first and messages[0]['role'] != 'system' -%}
        {{- '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' -}}
    {%- endif -%}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""

# Laid out for trim_blocks and lstrip_blocks (which transformers turns on), with a comment,
# double quotes, attribute access and a different default system message.
LAYOUT_CHATML = """{# ChatML with a default system message #}
{% for message in messages %}
    {% if loop.first and messages[0].role != "system" %}
        {{- "<|im_start|>system\\nYou are a helpful assistant<|im_end|>\\n" -}}
    {% endif %}
    {{- "<|im_start|>" + message.role + "\\n" + message.content + "<|im_end|>" + "\\n" -}}
{% endfor %}
{% if add_generation_prompt %}
    {{- "<|im_start|>assistant\\n" -}}
{% endif %}
"""

# No generation prompt block: add_generation_prompt then changes nothing.
NO_PROMPT = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nBe brief.<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + "
    "message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
)

UNSUPPORTED = [
    # Llama 3 style headers.
    "{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}{% endfor %}",
    # ChatML markers but an extra condition the renderer would ignore.
    "{% for message in messages %}{% if message['role'] == 'user' %}{{'<|im_start|>' + "
    "message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endif %}"
    "{% endfor %}",
    # Newlines between the tags are output: not plain ChatML any more.
    "{% for message in messages %}\n{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}\n{% endfor %}",
    # A filter on the content.
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] | trim + '<|im_end|>' + '\\n'}}{% endfor %}",
    # Unterminated tag.
    "{% for message in messages %}{{'<|im_start|>' + message['role']",
    "",
    "not a template at all",
]


def escape(s):
    out = []
    for ch in s:
        o = ord(ch)
        if ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif o < 0x20 or o == 0x7F:
            out.append("\\x%02x" % o)
        elif o > 0x7F and unicodedata.category(ch) in ("Cc", "Cf", "Zs", "Zl", "Zp"):
            # Invisible or line-breaking: spelled as its UTF-8 bytes.
            out.append("".join("\\x%02x" % b for b in ch.encode("utf-8")))
        else:
            out.append(ch)
    return "".join(out)


def field_str(reader, key):
    f = reader.fields[key]
    return bytes(f.parts[f.data[0]]).decode("utf-8")


def load_vocab(path):
    r = GGUFReader(path)
    f = r.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
    f = r.fields["tokenizer.ggml.token_type"]
    types = [int(f.parts[i][0]) for i in f.data]
    f = r.fields["tokenizer.ggml.merges"]
    merges = [tuple(bytes(f.parts[i]).decode("utf-8").split(" ", 1)) for i in f.data]
    assert field_str(r, "tokenizer.ggml.model") == "gpt2"
    assert field_str(r, "tokenizer.ggml.pre") == "smollm"
    return tokens, types, merges, field_str(r, "tokenizer.chat_template")


def build(tokens, types, merges, with_special):
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    if with_special:
        tok.add_special_tokens([
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types) if ty == CONTROL
        ])
    return tok


def gen_ids(root, tokens, types, merges):
    special = build(tokens, types, merges, True)
    plain = build(tokens, types, merges, False)
    lines = [
        "# SmolLM2-135M-Instruct tokenizer reference, generated by scripts/gen_tokenizer_cases.py",
        "# with HF tokenizers %s (byte-level BPE from the GGUF vocab and merges, Digits +"
        % __import__("tokenizers").__version__,
        "# ByteLevel pre-tokenizers; see the script). Format, tab-separated:",
        "#   flags  text  ids",
        "# flags: s = parse special tokens, n = do not; r = decode(encode(text)) == text (absent",
        "# when the text holds bytes that have no token and are dropped). Text escapes: \\\\ \\n",
        "# \\t \\r \\xHH (a byte: control characters, and the UTF-8 bytes of invisible or",
        "# line-breaking ones); everything else is literal UTF-8.",
    ]
    for parse_special, text in CASES:
        tok = special if parse_special else plain
        ids = tok.encode(text, add_special_tokens=False).ids
        back = tok.decode(ids, skip_special_tokens=False)
        flags = ("s" if parse_special else "n") + ("r" if back == text else "")
        lines.append("%s\t%s\t%s" % (flags, escape(text), " ".join(map(str, ids))))
    out = root / "tests" / "model" / "data" / "tokenizer_smollm2.txt"
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("wrote %d cases to %s" % (len(CASES), out.relative_to(root)), file=sys.stderr)


def gen_chat(root, gguf_template):
    # As transformers' apply_chat_template configures jinja2.
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    templates = [("smollm2", gguf_template), ("chatml", PLAIN_CHATML),
                 ("smollm2_trimmed", TRIMMED_SMOLLM2), ("layout", LAYOUT_CHATML),
                 ("no_prompt", NO_PROMPT)]
    lines = [
        "# Chat template reference, generated by scripts/gen_tokenizer_cases.py with jinja2 %s"
        % jinja2.__version__,
        "# (trim_blocks and lstrip_blocks on, as transformers renders chat templates).",
        "# template NAME TEXT: a template (smollm2 is the GGUF's tokenizer.chat_template)",
        "# case NAME ADD_GENERATION_PROMPT N, then N lines 'msg ROLE CONTENT', then",
        "# 'expect RENDERED'; 'unsupported TEXT' is a template the renderer must refuse.",
        "# Fields are tab-separated, escaped as in tokenizer_smollm2.txt.",
    ]
    for name, text in templates:
        lines.append("template\t%s\t%s" % (name, escape(text)))
    for name, text in templates:
        t = env.from_string(text)
        for conv in [[]] + CHAT_CONVERSATIONS:
            for add_gen in (0, 1):
                msgs = [{"role": r, "content": c} for r, c in conv]
                rendered = t.render(messages=msgs, add_generation_prompt=bool(add_gen))
                lines.append("case\t%s\t%d\t%d" % (name, add_gen, len(conv)))
                for r, c in conv:
                    lines.append("msg\t%s\t%s" % (escape(r), escape(c)))
                lines.append("expect\t%s" % escape(rendered))
    for text in UNSUPPORTED:
        lines.append("unsupported\t%s" % escape(text))
    out = root / "tests" / "model" / "data" / "tokenizer_chat.txt"
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("wrote chat cases to %s" % out.relative_to(root), file=sys.stderr)


def main():
    root = pathlib.Path(__file__).resolve().parent.parent
    if len(sys.argv) > 1:
        path = sys.argv[1]
    else:
        cache = os.environ.get("KVS_CACHE_DIR", os.path.expanduser("~/.cache/kvstage"))
        path = os.environ.get("KVS_MODEL",
                              os.path.join(cache, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    tokens, types, merges, template = load_vocab(path)
    gen_ids(root, tokens, types, merges)
    gen_chat(root, template)


if __name__ == "__main__":
    main()
