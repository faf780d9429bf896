"""The local dashboard: pages served by the control app, for people in a browser.

``pages.py`` reads the client layer's views (the ones the control API returns)
and renders ``templates/`` (Jinja2, autoescaped) with the plain values of
``views.py``; ``static/`` holds our own script and styles and the vendored
libraries (``static/vendor/VENDORED.md``), ``history.py`` keeps the last hour of
GPU readings that the charts draw. Every change a page makes goes through a
control API route; this package adds no way to change state of its own.
"""
