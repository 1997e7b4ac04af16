"""The tokenizer and chat template of a model folder, read without transformers.

Files read from the model folder (the layout `save_pretrained` writes, and the GGUF converter):
  tokenizer.json         required: the `tokenizers` (Rust) tokenizer, used as is
  tokenizer_config.json  optional: bos/eos/pad/unk tokens (strings or AddedToken dicts with
                         "content"), chat_template (a string, or a list of {"name", "template"}
                         from which "default" is taken)
  special_tokens_map.json  optional: the special tokens where tokenizer_config.json lacks them
  chat_template.jinja    optional: the chat template; it wins over tokenizer_config.json, as in
                         transformers 5

Chat templates render as transformers renders them: jinja2's ImmutableSandboxedEnvironment with
trim_blocks and lstrip_blocks, the loopcontrols extension, `raise_exception`, `strftime_now`,
a `tojson` filter that does not escape HTML, and the special tokens (bos_token, eos_token,
pad_token, unk_token) as variables. `{% generation %}` blocks render their body and track nothing.

Errors are TokenizerError naming the folder or file and the fix.
Caution: templates are untrusted code; the sandbox is jinja2's. Tool schemas pass through as
`tools` (the JSON given); documents and transformers' reasoning-field aliases are not supported.
Tested: tests/test_data.py renders several chats equal to transformers' apply_chat_template and
encodes equal ids on the SmolLM2 tokenizer.
"""
import json
from datetime import datetime
from pathlib import Path

import tokenizers

SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


class TokenizerError(ValueError):
    pass


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}:{e.lineno} is not valid JSON ({e.msg}): re-save the tokenizer "
                             "or fix the file") from e


def _token_str(value):
    """A special token as a string: tokenizer_config holds a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value, path: Path):
    """chat_template from tokenizer_config.json: a string, or a list of named templates."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" in named:
            return named["default"]
        raise TokenizerError(f"{path}: chat_template lists templates {sorted(map(str, named))} but none "
                             "is named 'default': rename the one to train with to 'default'")
    raise TokenizerError(f"{path}: chat_template is a {type(value).__name__}; expected a string or a "
                         "list of {'name', 'template'} entries")


def _compile_template(source: str, where: str):
    """Compile a chat template in the environment transformers renders with."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (no assistant tracking)."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"{where}:{e.lineno}: chat template does not compile ({e.message}): "
                             "fix the template") from e


def _load_error(tok_path: Path, e: Exception) -> TokenizerError:
    """Why tokenizer.json did not load: a file that is not JSON (cut off, empty, not UTF-8) is named
    as such; only a JSON file the `tokenizers` library refuses points at its version."""
    try:
        json.loads(tok_path.read_bytes())
    except (OSError, ValueError) as bad:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        where = f" at line {bad.lineno}" if isinstance(bad, json.JSONDecodeError) else ""
        size = tok_path.stat().st_size if tok_path.exists() else 0
        return TokenizerError(f"{tok_path} is not valid JSON{where} ({size:,} bytes; cut off or damaged?): "
                              "download or copy it again from the model's repository")
    return TokenizerError(f"{tok_path} does not load in tokenizers {tokenizers.__version__} ({e}): the file may "
                          "need a newer tokenizers (pip install -U tokenizers), or re-save it with this one")


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens and chat template of a model folder.

    bos_id, eos_id, pad_id, unk_id: token ids, or None where the folder names no such token
    (pad_id falls back to eos_id). special: {"bos_token": str, ...} as the template sees them.
    """

    def __init__(self, backend, special: dict, chat_template=None, name="<tokenizer>"):
        self.backend = backend
        self.name = name
        self.special = {k: v for k, v in special.items() if v is not None}
        self.chat_template = chat_template
        self._template = _compile_template(chat_template, name) if chat_template else None
        eos = self.special.get("eos_token")
        if eos is not None and backend.token_to_id(eos) is None:  # None would drop every document's EOS
            raise TokenizerError(f"{name}: eos_token={eos!r} is not in the tokenizer's vocabulary: fix "
                                 "tokenizer_config.json (or special_tokens_map.json) to name a token "
                                 "tokenizer.json has")
        self.bos_id = self._id(self.special.get("bos_token"))
        self.eos_id = self._id(self.special.get("eos_token"))
        self.unk_id = self._id(self.special.get("unk_token"))
        pad = self._id(self.special.get("pad_token"))
        self.pad_id = pad if pad is not None else self.eos_id

    @classmethod
    def from_dir(cls, model_dir):
        """Read tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja."""
        d = Path(model_dir)
        tok_path = d / "tokenizer.json"
        if not tok_path.exists():
            raise TokenizerError(
                f"{d} has no tokenizer.json: copy it from the model's Hugging Face repository, or "
                "write it with transformers' AutoTokenizer.from_pretrained(...).save_pretrained(folder) "
                "(a GGUF model: convert it with lean's GGUF converter, which writes the tokenizer)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_path))
        except Exception as e:  # the Rust side raises a plain Exception on bad files
            raise _load_error(tok_path, e) from e
        cfg_path = d / "tokenizer_config.json"
        cfg = _read_json(cfg_path)
        fallback = _read_json(d / "special_tokens_map.json")
        special = {k: _token_str(cfg.get(k)) or _token_str(fallback.get(k)) for k in SPECIAL_NAMES}
        template, where = _pick_template(cfg.get("chat_template"), cfg_path), str(cfg_path)
        jinja_path = d / "chat_template.jinja"
        if jinja_path.exists():
            template, where = jinja_path.read_text(encoding="utf-8"), str(jinja_path)
        return cls(backend, special, template, name=where if template else str(tok_path))

    def _id(self, token):
        return None if token is None else self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list:
        """Token ids of `text`; add_special_tokens applies tokenizer.json's post-processor (BOS...)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_offsets(self, text: str, add_special_tokens: bool = False):
        """(ids, offsets): offsets[t] = (start, end) character span of token t in `text`."""
        enc = self.backend.encode(text, add_special_tokens=add_special_tokens)
        return enc.ids, enc.offsets

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt: bool = False, tools=None) -> str:
        """Render messages ([{"role", "content"}, ...]) with the chat template, as a string; tools:
        function schemas, as transformers passes them (None when absent)."""
        if self._template is None:
            raise TokenizerError(f"{self.name}: the tokenizer has no chat template: add "
                                 "chat_template.jinja to the model folder, or train on plain text")
        # documents=None as transformers passes it: templates test `tools is not none`
        return self._template.render(messages=[dict(m) for m in messages],
                                     tools=[dict(t) for t in tools] if tools else None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self.special)
