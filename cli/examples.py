"""The examples every command's ``--help`` ends with, in one table.

:func:`add_examples` puts them in the epilog of each command of the group (a command that
declares an epilog of its own keeps it). tests/cli/test_cli_help.py checks that every
command has some and that every option an example uses exists.
"""

from __future__ import annotations

import click

__all__ = ["EXAMPLES", "add_examples", "examples_epilog"]

# command path -> example command lines (shell), the commonest use first; a long one is
# continued with a backslash and a newline, as in a shell
EXAMPLES: dict[str, tuple[str, ...]] = {
    "keygen": ("edgepack keygen release   # writes release.key (0600) and release.pub",),
    "convert": (
        "edgepack convert model.gguf -o model.epk --encoding int4-g32 --sign-key release.key",
        "edgepack convert hf-model/ -o model.epk --model-name smollm2 --model-version 1.2.0",
    ),
    "inspect": ("edgepack inspect model.epk", "edgepack inspect old-to-new.epkd --json"),
    "verify": (
        "edgepack verify model.epk --trusted-key release.pub",
        "edgepack verify model.epk --trusted-key a.pub --trusted-key b.pub --threshold 2",
    ),
    "fetch-sample": ("edgepack fetch-sample smollm2 --cache ~/.cache/edgepack/models",),
    "build": (
        "edgepack build model.gguf -o model.epk --target-bpw 4.5 --calib calib.jsonl",
        "edgepack build hf-model/ -o model.epk --recipe recipe.toml --sign-key release.key",
    ),
    "eval": (
        "edgepack eval model.epk --ref ref-f32.epk --ctx 512 --chunks 40",
        "edgepack eval model.epk --ref ref-f32.epk --ref-cache refcache/ --json",
    ),
    "profile-device": ("edgepack profile-device -o lut.json --model model.epk --repeats 5",),
    "run": (
        'edgepack run model.epk -p "The capital of France is" --max-tokens 16',
        "edgepack run model.epk --chat -f question.txt --stats-json stats.json",
        "printf 'Hi!\\nAnd in French?\\n' | edgepack run model.epk -cnv --system 'Be brief.'",
    ),
    "compare": (
        "edgepack compare ref-f32.epk model.epk --text sample.txt",
        "edgepack compare ref-f32.epk model.epk --text sample.txt --device --isolated",
    ),
    "export": (
        "edgepack export model.epk -o model.gguf   # then: llama-cli -m model.gguf",
    ),
    "bench": (
        "edgepack bench model.epk -p 512 -n 128 -r 5   # llama-bench -m model.gguf, same shape",
        "edgepack bench model.epk -p 0 -n 64 --json",
    ),
    "pack-adapter": (
        "edgepack pack-adapter base.epk peft-lora/ -o lora.epk --sign-key release.key",
        "edgepack pack-adapter base.epk peft-lora/ -o lora.epk --adapter-encoding f16 \\\n"
        "--model-version 1.0.1",
    ),
    "merge-lora": (
        "edgepack merge-lora base.epk peft-lora/ -o merged.epk --sign-key release.key",
        "edgepack merge-lora base.epk lora.epk -o merged.epk --source hf-model/",
    ),
    "diff": ("edgepack diff v1.epk v2.epk -o v1-to-v2.epkd --sign-key release.key",),
    "patch": ("edgepack patch v1.epk v1-to-v2.epkd -o v2.epk --trusted-key release.pub",),
    "repo init": ("edgepack repo init --store s3://bucket/models --keys-dir keys/",),
    "repo rotate-key": ("edgepack repo rotate-key timestamp --store releases/ --keys-dir keys/",),
    "repo renew-root": ("edgepack repo renew-root --store releases/ --keys-dir keys/",),
    "repo refresh": ("edgepack repo refresh --store releases/ --keys-dir keys/   # from cron",),
    "repo verify": ("edgepack repo verify --store releases/ --deep",),
    "repo gc": ("edgepack repo gc --store releases/ --grace 48 --delete",),
    "publish": (
        "edgepack publish model.epk --store releases/ --channel beta --rollout 10",
        "edgepack publish model.epk --store s3://bucket/models --channel stable --deltas 3",
    ),
    "promote": (
        "edgepack promote 1.2.0 --channel stable --model smollm2 --store releases/",
        "edgepack promote 1.2.0 --channel beta --rollout 50 --store releases/",
    ),
    "releases": ("edgepack releases --store releases/ --channel stable --json",),
    "serve": ("edgepack serve --store releases/ --host 0.0.0.0 --port 8080",),
    "resign": (
        "edgepack resign model.epk -o model-1.0.1.epk --model-version 1.0.1 \\\n"
        "--sign-key release.key",
    ),
    "update": (
        "edgepack update --server http://updates:8080 --slot-dir slots/ --device-id dev42 \\\n"
        "--channel stable --model smollm2 --trusted-root 1.root.json",
    ),
    "tuf-client init": ("edgepack tuf-client --metadata-dir meta/ init 1.root.json",),
    "tuf-client refresh": (
        "edgepack tuf-client --metadata-dir meta/ \\\n"
        "--metadata-url http://updates:8080/metadata refresh",
    ),
    "tuf-client download": (
        "edgepack tuf-client --metadata-dir meta/ --metadata-url http://updates:8080/metadata \\\n"
        "--target-base-url http://updates:8080/targets --target-dir out/ \\\n"
        "--target-name smollm2/stable/smollm2-1.2.0.epk download",
    ),
}


def examples_epilog(lines: tuple[str, ...]) -> str:
    """An epilog click prints as it is (``\\b``: no rewrapping)."""
    shown = (line.replace("\n", "\n      ") for line in lines)
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in shown)


def add_examples(group: click.Group, prefix: str = "") -> None:
    """Give every command of ``group`` (recursively) its :data:`EXAMPLES` epilog."""
    for name, command in group.commands.items():
        path = f"{prefix}{name}"
        if isinstance(command, click.Group):
            add_examples(command, f"{path} ")
        elif not command.epilog and path in EXAMPLES:
            command.epilog = examples_epilog(EXAMPLES[path])
