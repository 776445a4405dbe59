"""Jupyter widgets (ipywidgets + plotly FigureWidget). They read metrics and batches; they never drive workers."""
from .comparison import Comparison
from .dashboard import Dashboard
from .inspector import Inspector
