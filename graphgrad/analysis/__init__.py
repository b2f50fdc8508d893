"""tf.Graph -> LayerGraph: the analyser, layers, graph utilities, MetaGraph loading, pictures."""
