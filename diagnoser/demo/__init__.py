"""A small but real inference server (diagnoser.demo.server), a load generator (diagnoser.demo.loadgen) and the
`diagnoser demo` run that ties them to an attach (diagnoser.demo.run). torch is needed only here."""
