"""The Endpoint Picker: this gateway's routing as an Envoy external processor (Gateway API
Inference Extension). ``picker`` makes the choice per request, ``extproc`` speaks Envoy's
ext_proc protocol, ``server`` runs the gRPC server beside the HTTP one.
"""
