"""The web UI's static files (``static/``), served by ``service/api/routes/ui.py``."""
