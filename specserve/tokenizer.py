"""Tokenizer: a ``tokenizers.Tokenizer`` plus special tokens and the chat template (rendered with
Jinja2 the way HF does), loaded from an HF directory."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer


def _token_str(t):
    if isinstance(t, dict):
        return t.get("content")
    return t


class Tokenizer:
    def __init__(self, tok: HFTokenizer, bos_token=None, eos_token=None, chat_template=None,
                 add_bos_token=False, eos_token_ids=None):
        self.tok = tok
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = tok.token_to_id(bos_token) if bos_token else None
        ids = list(eos_token_ids or [])
        if eos_token and tok.token_to_id(eos_token) is not None:
            ids.insert(0, tok.token_to_id(eos_token))
        self.eos_token_ids = list(dict.fromkeys(ids))
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._template = None

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        f = path / "tokenizer.json"
        if not f.exists():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        model_cfg = _read_json(path / "config.json")
        template = cfg.get("chat_template")
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # list of named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        eos_ids = gen.get("eos_token_id", model_cfg.get("eos_token_id"))
        eos_ids = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids or [])
        return cls(
            HFTokenizer.from_file(str(f)),
            bos_token=_token_str(cfg.get("bos_token")),
            eos_token=_token_str(cfg.get("eos_token")),
            chat_template=template,
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            eos_token_ids=eos_ids,
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = True):
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass plain prompts to generate() instead")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                               extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(self.chat_template)
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"each message needs 'role' and 'content', got {m!r}")
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _raise(msg):
    raise jinja2.exceptions.TemplateError(msg)


def _read_json(p: Path) -> dict:
    return json.loads(p.read_text()) if p.exists() else {}
