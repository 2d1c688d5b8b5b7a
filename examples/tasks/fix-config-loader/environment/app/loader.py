import json


def load_port(path):
    """The integer 'port' of the JSON file at `path`; 8000 when absent."""
    with open(path) as f:
        data = json.loads(f)
    return int(data['port'])
