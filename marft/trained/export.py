"""Export a trained team to a self-contained folder other tools load.

The folder holds, per policy adapter (one per role, or one shared), a PEFT adapter folder that
``PeftModel.from_pretrained(base_model, folder)`` loads and vLLM serves as a LoRA; optionally (``merge``) each
role's adapter merged into a full copy of the base model (safetensors, ``<adapter>-merged/``); ``team.json``
(the base model, each role with its adapter folder and prompt, the workflow, the chat-template mode and the
sampling settings); and a ``README.md`` model card with the run's figures. ``marft export``
(:mod:`marft.cli.export`) is this module from the command line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

from marft.agents.adapters import tied_output_layer_allowed
from marft.agents.dtypes import TORCH_DTYPES
from marft.models.loading import resolve_model_path
from marft.runner.shared.checkpoint import read_checkpoint_meta
from marft.trained.evaluate import checkpoint_config, load_team
from marft.validation import check_writable_folder

TEAM_FILE = "team.json"


def export(load_path: str | Path, output_dir: str | Path, merge: bool = False, device: str | None = None) -> Path:
    """Write the team of the checkpoint at ``load_path`` to ``output_dir`` (created; it must be empty or new), loading
    it on ``device`` (default: the run's).

    Raises:
        FileExistsError: ``output_dir`` exists and is not empty. FileNotFoundError / CheckpointError: a bad checkpoint.
    """

    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file: export into a new folder")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty: export into a new folder")
    check_writable_folder("--output_dir", out)
    config, checkpoint = checkpoint_config(load_path)
    if device:
        config.model.device = device
    team, profile, _ = load_team(config, checkpoint)
    base = resolve_model_path(config.model.model_name_or_path)
    base = os.path.abspath(base) if os.path.isdir(base) else base  # the adapters name it from any folder
    out.mkdir(parents=True, exist_ok=True)
    for adapter in team.policy_adapters:
        save_adapter(team, adapter, out / adapter)
        _point_to_base(out / adapter, base)
        if merge:
            merge_adapter(base, out / adapter, out / f"{adapter}-merged", team.tokenizer, config)
    _, state = read_checkpoint_meta(checkpoint)
    team_file = {
        "base_model": config.model.model_name_or_path, "base_model_path": base,
        "roles": [{**dataclasses.asdict(spec), "adapter": team.agent_adapters[i],
                   **({"merged_model": f"{team.agent_adapters[i]}-merged"} if merge else {})} for i, spec in enumerate(profile)],
        "workflow": config.env.workflow, "max_turns": config.env.max_turns, "chat_template": config.model.chat_template,
        "sampling": {"temperature": config.model.temperature, "top_k": config.model.top_k,
                     "max_new_tokens": config.model.max_new_tokens, "context_window": config.model.context_window},
        "trained": {"checkpoint": str(checkpoint), "iteration": state.get("iteration"), "env_steps": state.get("env_steps"),
                    "env": config.env.env_name, "algorithm": config.algo.algorithm_name},
    }
    (out / TEAM_FILE).write_text(json.dumps(team_file, indent=2))
    (out / "README.md").write_text(model_card(team_file, checkpoint))
    return out


def save_adapter(team, adapter: str, folder: Path) -> Path:
    """``adapter``'s PEFT folder (``adapter_config.json``, ``adapter_model.safetensors``) written to ``folder``
    (peft puts an adapter named ``default`` at the top of the folder it is given, any other in a subfolder)."""
    staging = folder.parent / f".{folder.name}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    team.model.save_pretrained(staging, selected_adapters=[adapter], save_embedding_layers=False)
    saved = staging if (staging / "adapter_config.json").is_file() else staging / adapter
    os.replace(saved, folder)
    shutil.rmtree(staging, ignore_errors=True)
    return folder


def _point_to_base(folder: Path, base: str) -> None:
    """The adapter's ``adapter_config.json`` names the base model's folder (so peft and vLLM find it)."""
    path = folder / "adapter_config.json"
    adapter_config = json.loads(path.read_text())
    adapter_config["base_model_name_or_path"] = base
    path.write_text(json.dumps(adapter_config, indent=2))


def merge_adapter(base: str, adapter_folder: Path, out: Path, tokenizer, config) -> Path:
    """A full model: ``base`` with the adapter in ``adapter_folder`` merged in, saved to ``out`` (safetensors)
    with its tokenizer. Loads a fresh copy of the base in the run's dtype (``--dtype``; a float32 LoRA update
    merged into half-precision weights would be rounded away), so the team's own weights are untouched."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM


    model = AutoModelForCausalLM.from_pretrained(base, dtype=TORCH_DTYPES[config.model.dtype], trust_remote_code=config.model.trust_remote_code)
    with tied_output_layer_allowed():
        adapted = PeftModel.from_pretrained(model, str(adapter_folder))
    output, embedding = adapted.get_output_embeddings(), adapted.get_input_embeddings()
    output_layer = getattr(output, "base_layer", output)
    if (output is not output_layer or embedding is not getattr(embedding, "base_layer", embedding)) \
            and output_layer.weight is getattr(embedding, "base_layer", embedding).weight:
        # the output layer and the input embedding share a weight and one of them is adapted: untie them first, or the
        # merge would fold one's update into both
        output_layer.weight = torch.nn.Parameter(output_layer.weight.detach().clone())
        for config_part in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
            config_part.tie_word_embeddings = False
    merged = adapted.merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    shutil.copy(adapter_folder / "adapter_config.json", out / "merged_from_adapter_config.json")
    return out


def model_card(team_file: dict, checkpoint: Path) -> str:
    """The exported team's README: what it is, how to load each role, and the run's figures."""
    trained = team_file["trained"]
    summary_path = checkpoint.parent.parent / "summary.json"
    figures = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    if figures.get("checkpoint") is None or Path(figures["checkpoint"]).resolve() != checkpoint.resolve():
        figures = {}  # the run's figures are those of its last checkpoint, not of this one
    lines = [
        f"# A marft team: {', '.join(r['role'] for r in team_file['roles'])}", "",
        f"Trained with marft ({trained['algorithm']}) on `{trained['env']}` from `{team_file['base_model']}`, "
        f"checkpoint `{trained['checkpoint']}` ({trained['iteration']} iterations, {trained['env_steps']} env steps).", "",
    ]
    if "accuracy_before" in figures:
        lines += [f"Held-out success of the run: {figures['accuracy_before']:.3f} before training, {figures['accuracy_after']:.3f} after.", ""]
    lines += ["| role | adapter folder |", "|---|---|"] + [f"| {r['role']} | `{r['adapter']}/` |" for r in team_file["roles"]]
    lines += ["", "Load a role with transformers + peft:", "", "```python",
              "from peft import PeftModel", "from transformers import AutoModelForCausalLM", "",
              f"base = AutoModelForCausalLM.from_pretrained({team_file['base_model_path']!r})",
              f"agent = PeftModel.from_pretrained(base, \"<this folder>/{team_file['roles'][0]['adapter']}\")", "```", ""]
    if any("merged_model" in r for r in team_file["roles"]):
        lines += ["Each role is also a full model with its adapter merged in: " + ", ".join(f"`{r['merged_model']}/`" for r in team_file["roles"])
                  + " (`AutoModelForCausalLM.from_pretrained`).", ""]
    lines += ["`team.json` holds each role's prompt, the workflow and the sampling settings. The team itself: "
              f"`marft play --load_path {trained['checkpoint']} \"<problem>\"`.", ""]
    return "\n".join(lines)
