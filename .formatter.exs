[
  inputs: ["{mix,.formatter}.exs", "mix/*.exs", "{elixir,test,bench,examples}/**/*.{ex,exs}"],
  line_length: 120
]
