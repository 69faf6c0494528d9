"""Widgets with fixed model ids, so that a lesson run and saved in JupyterLab still shows them when it is
reopened (lesson 1, "the planner, interactive").

JupyterLab keeps a notebook's saved widget state as it was unless its `saveState` setting is on, and
a widget made afresh gets a new random id: after a run and a save, the outputs would name models that
the saved state does not hold ("Error displaying widget: model not found"). With fixed ids the kernel's
models, the outputs and the committed state always name the same models, with either setting.
"""

from __future__ import annotations

import ipywidgets

_LIVE: dict[str, ipywidgets.Widget] = {}  # by model id: running the cell again closes these first


def _made(kind: type[ipywidgets.Widget], model_id: str, **traits) -> ipywidgets.Widget:
    if model_id in _LIVE:
        _LIVE.pop(model_id).close()  # the frontend drops the old model before the new one opens
    widget = kind(model_id=model_id, **traits)
    _LIVE[model_id] = widget
    return widget


def pinned(
    kind: type[ipywidgets.DOMWidget], model_id: str, layout: dict | None = None, **traits
) -> ipywidgets.DOMWidget:
    """`kind(**traits)` with the model id `model_id`, its layout `model_id-layout` (with the traits in
    `layout`) and, when it has one, its style `model_id-style` (lesson 1)."""
    parts = {"layout": _made(ipywidgets.Layout, f"{model_id}-layout", **(layout or {}))}
    style = kind.class_traits().get("style")
    if style is not None:
        parts["style"] = _made(style.klass, f"{model_id}-style")
    return _made(kind, model_id, **parts, **traits)
