"""``ragfix export``: a LoRA adapter as the serving engines load it (merged checkpoint, GGUF LoRA,
vLLM recipe)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ragfix.cli.common import (
    BackendOptsOpt,
    CalibrationOpt,
    ModelOpt,
    backend_options,
    console,
    user_errors,
)
from ragfix.errors import ConfigError


def register(app: typer.Typer) -> None:
    """Add ``export`` to the CLI."""

    @app.command("export")
    def export_cmd(
        adapter: Annotated[
            Path | None, typer.Argument(help="LoRA adapter folder (ragfix distill's)")
        ] = None,
        out: Annotated[Path, typer.Option("--out", "-o", help="folder to write into")] = Path(
            "exports/ragfix"
        ),
        calibration: CalibrationOpt = None,
        backend_opt: BackendOptsOpt = None,
        model: ModelOpt = "smollm2",
        merged: Annotated[
            bool, typer.Option(help="write OUT/merged: the checkpoint with the LoRA merged")
        ] = True,
        gguf: Annotated[
            bool, typer.Option(help="write OUT/lora.gguf: the LoRA for llama.cpp and Ollama")
        ] = True,
        merged_type: Annotated[
            str,
            typer.Option(
                help="OUT/merged.gguf (a GGUF base only): the merged tensors' type, f32, f16 or "
                "q8_0 (the others are copied as they are)"
            ),
        ] = "f16",
        vllm_base: Annotated[
            str | None,
            typer.Option(
                help="what vllm serve loads as the base (default: the checkpoint ragfix loads "
                "for --model, a GGUF's dequantized folder: the weights the adapter was trained "
                "on)"
            ),
        ] = None,
        name: Annotated[str, typer.Option(help="the adapter's name on the vLLM server")] = "ragfix",
    ) -> None:
        """Export a LoRA adapter for the serving engines: OUT/merged (safetensors, compared
        with the unmerged adapter), OUT/merged.gguf (where the base is a GGUF), OUT/lora.gguf
        (llama-cli --lora, Ollama ADAPTER), the vLLM command (checked as vLLM reads
        adapter_config.json) and OUT/export.json. With --calibration (or --backend-opt
        channel=,layers=,factor=) instead of an adapter: channel scaling folded into q_proj and
        k_proj as OUT/folded (every token's query scaled)."""
        from ragfix.export import (
            MERGED_GGUF_TYPES,
            export_gguf_lora,
            export_merged,
            export_merged_gguf,
            fold_channel_scaling,
            vllm_recipe,
            write_export_report,
        )
        from ragfix.models.resolve import checkpoint_dir, resolve_model

        if calibration is not None or backend_opt:
            with user_errors():
                if adapter is not None:
                    raise ConfigError("give an adapter or a channel scaling, not both")
                options = backend_options(backend_opt, calibration, None)
                with console.status("folding and comparing with the runtime patch"):
                    folded = fold_channel_scaling(model, out / "folded", **options)
                path = write_export_report(out, {"model": model, "channel_scaling": folded})
            console.print(
                f"folded checkpoint: {folded['folder']} ({folded['scaling']}); largest logit "
                f"difference from the patch on every row: "
                f"{folded['max_abs_logit_diff_all_rows']:.2e}, from its default (last row): "
                f"{folded['max_abs_logit_diff_last_row_variant']:.2e}",
                highlight=False,
                soft_wrap=True,
            )
            console.print(f"report: {path}", highlight=False)
            return
        with user_errors():
            if adapter is None:
                raise ConfigError("give an adapter folder, or --calibration for channel scaling")
            if merged_type not in MERGED_GGUF_TYPES:
                raise ConfigError(
                    f"--merged-type {merged_type}: one of {', '.join(MERGED_GGUF_TYPES)}"
                )
            spec = resolve_model(model)
            base = vllm_base or checkpoint_dir(spec)
            report = {"adapter": str(adapter), "model": model}
            report["vllm"] = vllm_recipe(adapter, base, name)
            if gguf:
                report["gguf_lora"] = export_gguf_lora(adapter, model, out / "lora.gguf")
            if merged:
                with console.status("merging and comparing with the unmerged adapter"):
                    report["merged"] = export_merged(adapter, model, out / "merged")
                if spec.source == "gguf":
                    with console.status("merging into the base GGUF"):
                        report["merged_gguf"] = export_merged_gguf(
                            adapter,
                            model,
                            out / "merged.gguf",
                            base_gguf=spec.path,
                            tensor_type=merged_type,
                        )
            path = write_export_report(out, report)
        if merged:
            m = report["merged"]
            console.print(
                f"merged checkpoint: {m['folder']} (largest logit difference from the unmerged "
                f"adapter: {m['max_abs_logit_diff']:.2e} over {m['probe_tokens']} tokens)",
                highlight=False,
                soft_wrap=True,
            )
        if "merged_gguf" in report:
            g = report["merged_gguf"]
            console.print(
                f"merged GGUF: {g['file']} ({g['merged_tensors']} tensors merged as "
                f"{g['tensor_type']}, {g['copied_tensors']} copied; llama-cli -m FILE)",
                highlight=False,
                soft_wrap=True,
            )
        if gguf:
            console.print(
                f"GGUF LoRA: {report['gguf_lora']['file']} (llama-cli -m BASE.gguf --lora FILE; "
                "Ollama: ADAPTER FILE)",
                highlight=False,
                soft_wrap=True,
            )
        console.print(f"vLLM: {report['vllm']['command']}", highlight=False, soft_wrap=True)
        console.print(f"report: {path}", highlight=False)
