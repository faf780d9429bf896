"""The control API's handlers, one module per resource; :mod:`gpumesh.control.app`
lists them in its one route table."""
