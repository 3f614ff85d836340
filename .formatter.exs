[
  inputs: ["{mix,.formatter}.exs", "{elixir,test,bench,examples}/**/*.{ex,exs}"],
  line_length: 120
]
