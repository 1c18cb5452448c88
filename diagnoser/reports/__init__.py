"""Renderers: each turns a Diagnosis (and its capture) into one output format. A renderer only renders."""
