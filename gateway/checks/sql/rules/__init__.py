"""The rule families a statement is checked against, one module each, run by ``statement.py``.

``statements``  what the statement is and what it contains: kinds, commands, INTO, locks,
                variables
``functions``   the allow-list of functions, by the name the database resolves
``tables``      the tables named, read through SQL's scoping of CTEs; system catalogs
``columns``     denied columns, however they are reached
``limit``       the LIMIT of the outermost query
"""
