"""Print the variant label that PEP 825's reference resolution (variantlib) picks on this machine.

    python variant_choice.py cpuinfer-1.0-variants.json     -> a64neon   (or "none": the non-variant wheel)

The file names each namespace's provider plugin (`plugin-api`); it is asked in this interpreter, so under qemu-user
it sees the emulated CPU, given a /proc/cpuinfo that describes it (ci/aarch64_cpuinfo.py). The published provider
plugins (provider-variant-x86-64 and -aarch64 0.0.1.post2) predate variantlib 0.2.2's plugin protocol (no
get_all_configs), so its plugin loader refuses them: their get_supported_configs is called here and variantlib's
filter-and-sort does the rest.
"""

from __future__ import annotations

import importlib
import json
import sys


def supported_properties(plugin, namespace: str) -> list:
    """What a provider plugin reports on this CPU, as variantlib properties in its order of preference."""
    from variantlib.models.variant import VariantProperty

    return [VariantProperty(namespace, c.name, v) for c in plugin.get_supported_configs(None) for v in c.values]


def choose(variants_json: dict, properties: list) -> str | None:
    """The most preferred variant label of the file for these supported properties; None: no variant fits."""
    from variantlib.resolver.lib import sort_and_filter_supported_variants
    from variantlib.variants_json import VariantsJson

    vjson = VariantsJson(variants_json)
    ranked = sort_and_filter_supported_variants(
        list(vjson.variants.values()), properties, namespace_priorities=vjson.namespace_priorities
    )
    return next((v.label for v in ranked if not v.is_null_variant()), None)


def main(path: str) -> None:
    """Print the best label, or "none"."""
    with open(path) as f:
        data = json.load(f)
    properties = []
    for namespace, provider in data["providers"].items():
        if "plugin-api" not in provider:  # an installer's built-in provider (uv's x86-64 one)
            continue
        module, _, attr = provider["plugin-api"].partition(":")
        properties += supported_properties(getattr(importlib.import_module(module), attr)(), namespace)
    print(choose(data, properties) or "none")


if __name__ == "__main__":
    main(sys.argv[1])
