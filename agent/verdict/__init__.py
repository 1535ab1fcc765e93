"""Which process caused an incident: named rules over one evidence model, and the judge that gathers it."""
