"""The Ollama Modelfile written beside an exported GGUF (`ollama create NAME -f <stem>.Modelfile`).

For a model:
    FROM ./<file>.gguf
    TEMPLATE <Go template>   the chat template in Ollama's Go template language, for the two chat
                             formats lean's models use: ChatML (<|im_start|>role ... <|im_end|>:
                             SmolLM2, Qwen) and Llama 3's headers (<|start_header_id|>role
                             <|end_header_id|> ... <|eot_id|>); another template is left to Ollama,
                             which reads tokenizer.chat_template from the file itself
    PARAMETER stop "..."     the end-of-turn tokens of that format, and the model's EOS
For an adapter:
    FROM <base>              the run's base model: its .gguf when it trained on one, else a line to
                             fill in (the base model's GGUF, or an Ollama model of the same weights)
    ADAPTER ./<file>.gguf
Written atomically (temporary name, then rename), as the GGUF is.
Tested: tests/test_gguf_export.py (the file's lines for ChatML, Llama 3 and another template).
"""
import os
from pathlib import Path

from gguf import Keys

CHATML = ("<|im_start|>", '''{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
''', ("<|im_end|>",))
LLAMA3 = ("<|start_header_id|>", '''{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>

{{ .Content }}<|eot_id|>{{ end }}<|start_header_id|>assistant<|end_header_id|>

''', ("<|eot_id|>",))


def _write(path: Path, text: str):
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def modelfile_path(gguf_path) -> Path:
    gguf_path = Path(gguf_path)
    return gguf_path.with_name(f"{gguf_path.stem}.Modelfile")


def write_modelfile(gguf_path, vocab: dict) -> Path:
    """<stem>.Modelfile beside a model's GGUF; vocab: gguf_vocab.vocab_metadata's result."""
    gguf_path = Path(gguf_path)
    template = (vocab.get(Keys.Tokenizer.CHAT_TEMPLATE) or ("",))[0]
    tokens = vocab[Keys.Tokenizer.LIST][0]
    lines = [f"# ollama create <name> -f {modelfile_path(gguf_path).name}", f"FROM ./{gguf_path.name}"]
    stops = []
    for marker, go, ends in (CHATML, LLAMA3):
        if marker in template:
            lines.append(f'TEMPLATE """{go}"""')
            stops += ends
            break
    else:
        lines.append("# TEMPLATE: Ollama reads the chat template from the GGUF (tokenizer.chat_template)")
    eos = vocab.get(Keys.Tokenizer.EOS_ID)
    if eos is not None and tokens[eos[0]] not in stops:
        stops.append(tokens[eos[0]])
    lines += [f'PARAMETER stop "{s}"' for s in stops]
    path = modelfile_path(gguf_path)
    _write(path, "\n".join(lines) + "\n")
    return path


def write_adapter_modelfile(gguf_path, base=None) -> Path:
    """<stem>.Modelfile beside an adapter's GGUF: FROM the base (a .gguf path, or a line to fill in)."""
    gguf_path = Path(gguf_path)
    lines = [f"# ollama create <name> -f {modelfile_path(gguf_path).name}"]
    if base is not None:
        lines.append(f"FROM {Path(base).resolve()}")
    else:
        lines += ["# FROM: the base model the adapter trained on, as a GGUF path or an Ollama model of the same",
                  "# weights (lean-export --gguf F16 without --adapter writes one), e.g.", "# FROM ./model-F16.gguf"]
    lines.append(f"ADAPTER ./{gguf_path.name}")
    path = modelfile_path(gguf_path)
    _write(path, "\n".join(lines) + "\n")
    return path
