"""The web UI's static files (``static/``): one page, no build step, no CDN."""
